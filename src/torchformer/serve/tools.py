"""Tool calls, the request side: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and the
tool fields of messages, checked (a 400 naming the field, before any tensor work), and what a
request with tools asks of the rest of the server.

- ``none``: the template is rendered without the tools and the answer is plain content (OpenAI:
  the model does not call a tool).
- ``auto`` (the default with tools): the template renders them, the model writes freely, and
  its answer is parsed (tool_formats.py) into ``message.tool_calls`` when it holds calls.
- ``required`` / a named function: as auto, and the grammar (grammar.py, a structural tag of the
  family's call syntax around each function's ``parameters`` schema) makes the answer one call
  (or several, with ``parallel_tool_calls``) whose arguments validate.

Messages go to the template as transformers' chat templates expect them: an assistant's
``tool_calls`` with ``function.arguments`` parsed into an object, a ``tool`` message with its
``tool_call_id``.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from .errors import bad
from .grammar import ResponseFormat
from .tool_formats import structural_tag

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


class Tools(NamedTuple):
    functions: tuple[dict, ...]  # {"name", "parameters"} of each tool
    listed: list  # the request's tools, as the template renders them
    choice: str  # "auto" | "required" | "function"
    named: str | None  # the function a named tool_choice asks for
    parallel: bool

    def grammar(self, fmt: str) -> ResponseFormat | None:
        """The constraint of a required or named call in format ``fmt`` (None with auto)."""
        if self.choice == "auto":
            return None
        allowed = [f for f in self.functions if self.named in (None, f["name"])]
        return ResponseFormat("structural_tag", json.dumps(structural_tag(allowed, fmt, self.parallel)))


def tool_request(body: dict) -> Tools | None:
    """The request's tools, checked; None when there are none or ``tool_choice`` is "none"."""
    listed = body.get("tools")
    if listed is not None and not isinstance(listed, list):
        raise bad("tools", f"{listed!r} must be a list of {{'type': 'function', 'function': {{...}}}} objects")
    functions = tuple(function(i, t) for i, t in enumerate(listed or []))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise bad("tools", f"function names must be unique; {twice} appear more than once")
    choice, named = tool_choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise bad("parallel_tool_calls", f"{parallel!r} must be true or false")
    if choice == "none" or not functions:
        return None
    if choice != "auto" and body.get("response_format") is not None:
        raise bad(
            "response_format",
            f"cannot be combined with tool_choice {body['tool_choice']!r}: the answer is then a tool call",
        )
    return Tools(functions, listed, "function" if named else choice, named, parallel is not False)


def function(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad(
            where, f"{short(tool)} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
        )
    spec = tool["function"]
    extra = set(tool) - {"type", "function"} or set(spec) - {"name", "description", "parameters", "strict"}
    if extra:
        raise bad(where, f"unknown keys {sorted(extra)}")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad(f"{where}.function.name", f"{name!r}: required, 1-64 letters, digits, '_' or '-'")
    parameters = spec.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad(
            f"{where}.function.parameters",
            f"{short(parameters)} must be a JSON schema of an object ({{'type': 'object', 'properties': ...}})",
        )
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise bad(f"{where}.function.description", f"{spec['description']!r} must be a string")
    return {"name": name, "parameters": {"type": "object", **parameters}}


def tool_choice(value, names: list[str]) -> tuple[str, str | None]:
    """("none" | "auto" | "required", None) or ("function", its name)."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise bad("tool_choice", f"{value!r} is not one of {list(CHOICES)} or {{'type': 'function', ...}}")
        if value != "none" and not names:
            raise bad("tool_choice", f"{value!r} needs tools; this request has none")
        return value, None
    spec = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str):
        raise bad(
            "tool_choice",
            f"{short(value)} must be one of {list(CHOICES)} or {{'type': 'function', 'function': {{'name': ...}}}}",
        )
    if name not in names:
        raise bad("tool_choice.function.name", f"{name!r} is not one of the request's tools {names}")
    return "function", name


def message_tools(i: int, m: dict) -> dict:
    """The tool fields of messages[i] checked, and shaped as chat templates read them."""
    out = dict(m)
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise bad(
                f"messages[{i}].tool_call_id",
                f"{m.get('tool_call_id')!r}: required in a tool message, the id of the call it answers",
            )
    elif "tool_call_id" in m:
        raise bad(f"messages[{i}].tool_call_id", "only a message with role 'tool' has one")
    calls = m.get("tool_calls")
    if calls is None:
        out.pop("tool_calls", None)
        return out
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls", "only an assistant message has tool_calls, a list of calls")
    out["tool_calls"] = [message_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return out


def message_call(where: str, call) -> dict:
    spec = call.get("function") if isinstance(call, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad(where, f"{short(call)} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = spec.get("arguments", "{}")
    try:  # templates write the arguments with tojson: they take an object (as transformers does)
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad(f"{where}.function.arguments", f"{short(arguments)} must be a JSON object (as text)")
    return {"id": call.get("id"), "type": "function", "function": {"name": spec["name"], "arguments": parsed}}


def short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
