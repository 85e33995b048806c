"""Tool-call formats: how a model family writes its calls, found from its chat template, parsed
out of its text, and written as a grammar when a call is required.

One table (``FORMATS``), one entry per family, each a small record of its syntax:

- ``hermes`` (Qwen2.5 / Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, blocks separated by a newline; text outside the blocks is content.
- ``llama3`` (Llama 3.1 / 3.2 JSON tool calling): ``{"name": ..., "parameters": {...}}``, the whole
  answer, optionally after ``<|python_tag|>``; several calls separated by ``; ``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. ``[TOOL_CALLS]`` is a
  special token in Mistral's tokenizers, which the server's detokenizer drops (it skips special
  tokens), so an answer that is a bare JSON list of calls is read as calls too.

Text that does not parse whole (a broken block, a call without a name, arguments that are not an
object) stays content: a call is only reported when it is certainly one. The grammar forms
(``structural_tag``) are xgrammar structural tags: the literal wrapper of the family around a JSON
schema per function, so the arguments of a required call always validate against its parameters.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import NamedTuple


class Syntax(NamedTuple):
    name: str
    markers: tuple[str, ...]  # text only this family's chat templates hold
    start: str  # before the first call (all calls share it)
    close: str  # after the last call
    open_call: str  # one call's head, with {name} (JSON-quoted) filled in
    close_call: str
    separator: str  # between calls
    key: str  # the arguments' key in a call object


FORMATS = {
    "hermes": Syntax(
        name="hermes", markers=("<tool_call>",), start="", close="",
        open_call='<tool_call>\n{{"name": {name}, "arguments": ', close_call="}\n</tool_call>", separator="\n",
        key="arguments",
    ),
    "llama3": Syntax(
        name="llama3", markers=("<|python_tag|>", "ipython"), start="", close="",
        open_call='{{"name": {name}, "parameters": ', close_call="}", separator="; ", key="parameters",
    ),
    "mistral": Syntax(
        name="mistral", markers=("[TOOL_CALLS]",), start="[TOOL_CALLS][", close="]",
        open_call='{{"name": {name}, "arguments": ', close_call="}", separator=", ", key="arguments",
    ),
}  # fmt: skip
DEFAULT = "hermes"  # the most common family; a template with no known marker gets it
PYTHON_TAG = "<|python_tag|>"


def detect(template: str | None) -> str:
    """The format whose markers the chat template's text holds (the first found), else hermes."""
    for name, syntax in FORMATS.items():
        if template and any(m in template for m in syntax.markers):
            return name
    return DEFAULT


class Call(NamedTuple):
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it

    def openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    """OpenAI's shape: call_ and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


def one_call(value, key: str) -> Call | None:
    """A parsed JSON value as a call, or None when it is not one: an object with a string name and
    an object of arguments (some models write the arguments as a JSON string of an object)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    # The arguments' key must be there: {"name": "Bob", "age": 3} is an answer, not a call.
    args = next((value[k] for k in (key, "arguments", "parameters") if k in value), None)
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(value["name"], json.dumps(args, ensure_ascii=False))


def json_values(text: str, separator: str) -> list | None:
    """The JSON values of ``text`` written one after another with ``separator`` (and any
    whitespace) between them, or None when anything else is there."""
    decoder, values, i, sep = json.JSONDecoder(), [], 0, separator.strip()
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)
        rest = text[i:].lstrip()
        if not rest:
            return values
        if not sep or not rest.startswith(sep):
            return None
        i = len(text) - len(rest) + len(sep)


def calls_of(values, key: str) -> list[Call] | None:
    calls = [one_call(v, key) for v in values]
    return None if not calls or None in calls else calls


HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> tuple[str, list[Call]]:
    blocks = list(HERMES_BLOCK.finditer(text))
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        values = json_values(block.group(1), "")
        found = None if values is None or len(values) != 1 else one_call(values[0], FORMATS["hermes"].key)
        if found is None:
            return text, []  # a broken block: the text is the model's, unparsed
        calls.append(found)
    content = HERMES_BLOCK.sub("", text)
    return ("" if not content.strip() else content.strip()), calls


def parse_llama3(text: str) -> tuple[str, list[Call]]:
    body = text.strip()
    body = body[len(PYTHON_TAG) :] if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    values = json_values(body, ";")
    calls = None if values is None else calls_of(values, FORMATS["llama3"].key)
    return ("", calls) if calls else (text, [])


def parse_mistral(text: str) -> tuple[str, list[Call]]:
    head, marker, body = text.partition("[TOOL_CALLS]")
    if not marker:  # the marker was a special token the detokenizer dropped: a bare list of calls
        head, body = "", text
        if not text.lstrip().startswith("[{"):
            return text, []
    values = json_values(body, ",")
    if values is not None and len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    calls = None if values is None else calls_of(values, FORMATS["mistral"].key)
    return (head.strip(), calls) if calls else (text, [])


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral}


def parse(text: str, fmt: str) -> tuple[str, list[Call]]:
    """(content, calls) of a model's answer in format ``fmt``; with no call, the text unchanged."""
    return PARSERS[fmt](text)


def may_start(text: str, fmt: str) -> int:
    """Where in ``text`` a call may begin (the rest is held back while streaming), or len(text)
    when none can: a marker, or its beginning cut off at the end of the text so far."""
    if fmt == "llama3":  # the answer is a call only if it opens as one
        body = text.lstrip()
        opens = body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body)
        return 0 if opens else len(text)
    marker = "<tool_call>" if fmt == "hermes" else "[TOOL_CALLS]"
    if fmt == "mistral" and "[{".startswith(text.lstrip()[:2]):  # a bare list, the marker dropped
        return 0
    found = text.find(marker)
    if found >= 0:
        return found
    for cut in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-cut:]):
            return len(text) - cut
    return len(text)


def structural_tag(functions: list[dict], fmt: str, parallel: bool) -> dict:
    """The xgrammar structural tag of one or more calls (only one without ``parallel``) to
    ``functions`` ({"name", "parameters"}) in format ``fmt``, nothing else around them."""
    syntax = FORMATS[fmt]
    tags = [
        {
            "type": "tag",
            "begin": syntax.open_call.format(name=json.dumps(f["name"])),
            # One whitespace at most between JSON tokens: a model cannot pad a call forever.
            "content": {"type": "json_schema", "json_schema": f["parameters"], "max_whitespace_cnt": 1},
            "end": syntax.close_call,
        }
        for f in functions
    ]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": syntax.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if syntax.start or syntax.close:
        calls = {"type": "sequence", "elements": [const(syntax.start), calls, const(syntax.close)]}
    return {"type": "structural_tag", "format": calls}


def const(text: str) -> dict:
    return {"type": "const_string", "value": text}


class CallStream:
    """Streaming one choice whose answer may hold calls: text is sent as content until a call may
    begin; from there it is held, and parsed at the end (calls, or content after all)."""

    def __init__(self, fmt: str) -> None:
        self.fmt, self.text, self.sent = fmt, "", 0

    def feed(self, text: str) -> str:
        """The content that can be sent now."""
        self.text += text
        hold = max(self.sent, may_start(self.text, self.fmt))
        out, self.sent = self.text[self.sent : hold], hold
        return out

    def end(self) -> tuple[str, list[Call]]:
        """(the content still to send, the calls) once the choice has ended."""
        content, calls = parse(self.text[self.sent :], self.fmt)
        return content, calls
