"""OpenAI request bodies -> validated parameters, and the OpenAI error envelope.

Every field of a request is either understood, accepted because it changes nothing we compute
(``user``), or refused with a 400 naming it: a server that silently ignores ``n=3`` or
``logprobs=5`` returns something the caller did not ask for. Extensions beyond the OpenAI API
(``top_k``, ``min_p``, ``repetition_penalty``, ``return_token_ids``) are the same ones vLLM takes;
``response_format`` is checked in grammar.py (completions take it too, as vLLM's do), ``tools``,
``tool_choice``, ``parallel_tool_calls`` and the messages' tool fields in tools.py (chat only).
``n``, ``logprobs`` / ``top_logprobs`` and ``echo`` are checked in ``choices`` (the 400 names the
field, its value and what is allowed); ``n`` beyond the engine's rows is the engine's 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..generation.request import sampling_options
from ..generation.sampling import Sampling
from .errors import APIError, bad, shutting_down  # noqa: F401 (the serve modules import them from here too)
from .grammar import response_format
from .tools import message_tools

MAX_STOP = 4  # OpenAI allows up to 4 stop sequences
MAX_N = 128  # OpenAI's limit; the engine's rows (--slots) bound it further
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # OpenAI: top_logprobs 0-20 (chat), logprobs 0-5 (legacy)


@dataclass(frozen=True)
class Params:
    """What the engine needs to run one request, validated."""

    max_tokens: int | None  # None = the rest of the context
    sampling: Sampling
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    n: int = 1  # choices, each its own row (the prompt prefilled once)
    logprobs: int | None = None  # None: off; else the alternatives reported per token (top_logprobs)
    echo: bool = False  # completions: the prompt's text (and its tokens' logprobs) comes back first
    response_format: object = None  # grammar.ResponseFormat: the output is constrained to it


# Fields that change nothing we compute; everything not named anywhere is refused.
HARMLESS = {"user", "metadata", "store", "service_tier"}
# Fields OpenAI defines whose only value we support is the neutral one (anything else is a 400).
NEUTRAL = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
}
SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop"}
COMMON = {"model", "stream", "stream_options", "return_token_ids", "n", "logprobs", "response_format"} | SAMPLING
COMPLETION_FIELDS = COMMON | {"prompt", "echo"}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}


def check_text(body) -> None:
    """A 400 naming the first string, key or value, that is not Unicode text: JSON may escape a
    lone surrogate ("\\ud800"), which no tokenizer takes and no UTF-8 answer can carry. Walks
    with a stack (a deep body must not recurse); fields are named as in other errors:
    ``messages[0].content``."""
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not valid_text(value):
            raise bad(path, f"{printable(value)} holds a lone surrogate, which is not text", "invalid_text")
        if isinstance(value, dict):
            for key, item in value.items():
                name = key if not path else f"{path}.{key}"
                if not valid_text(key):
                    raise bad(
                        printable(name)[1:-1], "this key holds a lone surrogate, which is not text", "invalid_text"
                    )
                stack.append((name, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def valid_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(s: str, limit: int = 60) -> str:
    """A short quoted form of user text that any answer can carry (surrogates escaped)."""
    short = s if len(s) <= limit else s[:limit] + "..."
    return "'" + short.encode("utf-8", "backslashreplace").decode() + "'"


def check_fields(body, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in allowed or key in HARMLESS:
            continue
        if key in NEUTRAL:
            if any(value == ok and type(value) is type(ok) for ok in NEUTRAL[key] if ok is not None) or value is None:
                continue
            raise bad(
                key, f"{value!r} is not supported by this server (only {NEUTRAL[key][1:]!r})", "unsupported_value"
            )
        raise bad(key, f"unknown parameter; allowed: {sorted(allowed | HARMLESS)}", "unknown_parameter")


def number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(key, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise bad(key, f"{value!r} must be {kind} in [{lo}, {hi}]")
    return value


def stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > MAX_STOP:
        raise bad("stop", f"{value!r} must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    return tuple(items)


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise bad(key, f"{value!r} must be true or false")
    return bool(value)


def choices(body: dict, endpoint: str) -> tuple[int, int | None, bool]:
    """(n, logprobs, echo): what the response holds. Chat: ``logprobs`` true/false and
    ``top_logprobs`` 0-20 (which needs logprobs true); completions: ``logprobs`` 0-5 (the legacy
    integer) and ``echo``."""
    n = number(body, "n", 1, 1, MAX_N, integer=True)
    most = MAX_TOP_LOGPROBS[endpoint]
    if endpoint == "chat":
        on = flag(body, "logprobs")
        top = number(body, "top_logprobs", None, 0, most, integer=True)
        if top is not None and not on:
            raise bad("top_logprobs", f"{top!r} needs logprobs: true (top_logprobs is 0-{most} alternatives per token)")
        return n, (top or 0) if on else None, False
    return n, number(body, "logprobs", None, 0, most, integer=True), flag(body, "echo")


def params(body: dict, max_tokens_key: str, default_max_tokens: int | None, endpoint: str = "chat") -> Params:
    """The sampling/limit fields shared by both endpoints (after ``check_fields``)."""
    n, logprobs, echo = choices(body, endpoint)
    # max_tokens 0 only echoes the prompt (with its logprobs): what lm-eval's loglikelihood asks.
    least = 0 if echo else 1
    if body.get(max_tokens_key) == 0 and not echo:
        raise bad(max_tokens_key, "0 must be >= 1 (0 only with echo: true, to score the prompt)")
    max_tokens = number(body, max_tokens_key, default_max_tokens, least, 2**31, integer=True)
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad("top_p", "0 keeps no token: use a value in (0, 1]")
    top_k = number(body, "top_k", None, -1, 2**31, integer=True)
    top_k = None if top_k in (None, -1, 0) else top_k  # vLLM spells "off" as -1 (and 0)
    min_p = number(body, "min_p", None, 0.0, 1.0)
    min_p = None if min_p == 0 else min_p
    repetition_penalty = number(body, "repetition_penalty", 1.0, 1e-6, 100.0)
    seed = number(body, "seed", None, 0, 2**63 - 1, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"{stream!r} must be true or false")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("stream_options", f"{options!r}: only {{'include_usage': bool}}, and only with stream=true")
    include_usage = bool((options or {}).get("include_usage", False))
    token_ids = body.get("return_token_ids", False)
    if not isinstance(token_ids, bool):
        raise bad("return_token_ids", f"{token_ids!r} must be true or false")
    sampling = sampling_options(temperature, top_k, None if top_p == 1.0 else top_p, min_p, repetition_penalty, 0)
    stop = stops(body.get("stop"))
    fmt = response_format(body.get("response_format"))
    return Params(max_tokens, sampling, seed, stop, stream, include_usage, token_ids, n, logprobs, echo, fmt)


def new_tokens(prompt_tokens: int, params: Params, context: int) -> int:
    """The tokens a request may generate (max_tokens, or the rest of the context), or the 400
    (OpenAI's wording) when the prompt and max_tokens do not fit the model's context."""
    max_tokens = context - prompt_tokens if params.max_tokens is None else params.max_tokens
    if max_tokens < (0 if params.echo else 1) or prompt_tokens + max_tokens > context:
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + max(max_tokens, 1)} tokens ({prompt_tokens} in the prompt, "
            f"{max(max_tokens, 1)} for the completion). Please reduce the prompt or max_tokens.",
            param="messages" if params.max_tokens is None else "max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def check_model_name(body: dict, served: str) -> None:
    """Requests name the served model by its id; they cannot point the server at another path."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("model", f"{name!r}: required, the id of the served model ({served!r})")
    if name != served:
        raise APIError(
            404,
            f"model {name!r} is not served here; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def completion_request(body, served: str) -> tuple[str | list[int], Params]:
    check_fields(body, COMPLETION_FIELDS)
    check_model_name(body, served)
    prompt = body.get("prompt")
    # OpenAI allows a batch of prompts; with n = 1 only one prompt per request is served.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    is_ids = isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_ids:
        raise bad("prompt", "must be a non-empty string or a non-empty list of token ids (one prompt per request)")
    return prompt, params(body, "max_tokens", 16, "completions")  # 16: OpenAI's default for completions


def chat_request(body, served: str) -> tuple[list[dict], Params]:
    check_fields(body, CHAT_FIELDS)
    check_model_name(body, served)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad("max_tokens", "give max_tokens or max_completion_tokens, not both")
    key = "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"
    return messages(body.get("messages")), params(body, key, None)


MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def messages(value) -> list[dict]:
    """Messages as the template sees them: role and text content (text parts are joined), and
    the tool fields (tools.py: an assistant's tool_calls, a tool message's tool_call_id)."""
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or set(m) - MESSAGE_KEYS:
            raise bad(
                f"messages[{i}]",
                f"{m!r} must be an object with role, content (and optionally name, tool_calls, tool_call_id)",
            )
        m = message_tools(i, m)
        content = m.get("content")
        if content is None and m.get("tool_calls"):  # an assistant's calls need no text
            content = ""
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise bad(f"messages[{i}].content", "only text parts ({'type': 'text', 'text': ...}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"{content!r} must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out
