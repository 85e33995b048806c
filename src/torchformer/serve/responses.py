"""Response and stream-chunk bodies, shaped as the OpenAI API (``text_completion``,
``chat.completion``, ``chat.completion.chunk``): one id and ``created`` per request, the same
id on every chunk, ``finish_reason`` "stop" or "length", usage with total_tokens (the prompt
counted once, the completion tokens of all n choices), each choice with its ``index``."""

from __future__ import annotations

import time
import uuid

from .call_stream import CallStream
from .jobs import Delta, Done, Prompt
from .logprob_shapes import ChatLogprobs, CompletionLogprobs, TokenText
from .tool_formats import call_id, parse


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # reused from a row's cache (prefix.py)
    }


class Choice:
    """One choice of a full (not streamed) answer, gathered from its events."""

    def __init__(self, index: int, logprobs) -> None:
        self.index, self.logprobs = index, logprobs  # a ChatLogprobs / CompletionLogprobs, or None
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.done: Done | None = None

    def add(self, event, echo: str) -> None:
        if isinstance(event, Prompt):
            self.text.append(echo)
        elif isinstance(event, Delta):
            self.text.append(event.text)
            self.tokens.extend(event.token_ids)
        else:
            self.done = event
        if self.logprobs is not None and isinstance(event, Prompt | Delta):
            self.logprobs.add(event.logprobs)


class CompletionShape:
    """/v1/completions: choices carry ``text``."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"
    logprobs_class = CompletionLogprobs

    def __init__(self, model: str, prompt_ids: list[int], return_token_ids: bool, text_of: TokenText = str) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.prompt_ids, self.return_token_ids = model, prompt_ids, return_token_ids
        self.text_of = text_of  # a token id's text, for logprobs

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def new_logprobs(self):
        return self.logprobs_class(self.text_of)

    def choice(self, index: int, text: str, finish_reason: str | None, token_ids, logprobs: dict | None) -> dict:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.with_ids(out, token_ids)

    def with_ids(self, choice: dict, token_ids: list[int] | None) -> dict:
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids  # extension, as vLLM's return_token_ids
        return choice

    def full(self, choices: list[Choice], use: dict) -> dict:
        out = [
            self.choice(
                c.index,
                "".join(c.text),
                c.done.finish_reason,
                c.tokens,
                None if c.logprobs is None else c.logprobs.full(),
            )
            for c in choices
        ]
        body = {**self.head(self.object), "choices": out, "usage": use}
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return body

    def chunk(
        self, index: int, text: str, token_ids, finish_reason, include_usage: bool, logprobs=None, tool_calls=()
    ) -> dict:
        choice = self.choice(index, text, finish_reason, token_ids, logprobs)
        body = {**self.head(self.chunk_object), "choices": [choice]}
        if include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def first(self, index: int, include_usage: bool) -> dict | None:
        return None  # completions have no opening chunk

    def streamed(self, index: int, text: str) -> tuple[str, list[dict]]:
        """The part of a choice's new text to send now, and tool_calls deltas (chat with tools)."""
        return text, []

    def closing(self, index: int, finish_reason: str, include_usage: bool) -> list[dict]:
        """The chunks that end a choice's stream."""
        return [self.chunk(index, "", None, finish_reason, include_usage)]

    def usage_chunk(self, use: dict) -> dict:
        return {**self.head(self.chunk_object), "choices": [], "usage": use}


class ChatShape(CompletionShape):
    """/v1/chat/completions: choices carry ``message`` (full) or ``delta`` (chunks)."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    logprobs_class = ChatLogprobs

    def __init__(self, *args, tool_format: str | None = None, **kwargs) -> None:
        """``tool_format``: the request has tools, written by the model in this format
        (tool_formats.py): answers are parsed into ``tool_calls``."""
        super().__init__(*args, **kwargs)
        self.tool_format, self.streams = tool_format, {}

    def choice(self, index: int, text: str, finish_reason: str | None, token_ids, logprobs: dict | None) -> dict:
        message = {"role": "assistant", "content": text, "refusal": None}
        content, calls = parse(text, self.tool_format) if self.tool_format else (text, [])
        if calls:
            message.update(content=content or None, tool_calls=[c.openai(call_id()) for c in calls])
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        out = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.with_ids(out, token_ids)

    def streamed(self, index: int, text: str) -> tuple[str, list[dict]]:
        if self.tool_format is None:
            return text, []
        return self.streams.setdefault(index, CallStream(self.tool_format)).feed(text)

    def closing(self, index: int, finish_reason: str, include_usage: bool) -> list[dict]:
        """What the call stream still held (content, or calls parsed whole), then the finish_reason
        ("tool_calls" once a call was sent)."""
        stream, out = self.streams.get(index), []
        content, calls = stream.end() if stream is not None else ("", [])
        if content or calls:
            out.append(self.chunk(index, content, None, None, include_usage, tool_calls=calls))
        reason = "tool_calls" if stream is not None and stream.calls and finish_reason == "stop" else finish_reason
        return [*out, self.chunk(index, "", None, reason, include_usage)]

    def chunk(
        self, index: int, text: str, token_ids, finish_reason, include_usage: bool, logprobs=None, tool_calls=()
    ) -> dict:
        delta = {"content": text} if text or (finish_reason is None and not tool_calls) else {}
        if tool_calls:
            delta["tool_calls"] = list(tool_calls)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {**self.head(self.chunk_object), "choices": [self.with_ids(choice, token_ids)]}
        if include_usage:
            body["usage"] = None
        return body

    def first(self, index: int, include_usage: bool) -> dict | None:
        # OpenAI opens a chat stream with the role and empty content (per choice).
        delta = {"role": "assistant", "content": ""}
        body = {
            **self.head(self.chunk_object),
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
        }
        if include_usage:
            body["usage"] = None
        return body
