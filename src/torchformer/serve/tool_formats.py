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
object) stays content: a call is only reported when it is certainly one. Its arguments are the
text the model wrote for them (a JSON object), so streaming them piece by piece as they come
(call_stream.py) gives the client the same text. The grammar forms
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


def children(text: str, start: int) -> list[tuple[str | None, int, int]]:
    """The members (key, value start, value end) of the JSON object, or the items (None, start,
    end) of the JSON array, that begins at ``start`` of ``text`` (known to be valid JSON)."""
    decoder, out, i = json.JSONDecoder(), [], skip(text, start + 1)
    while text[i] not in "}]":
        key = None
        if text[start] == "{":
            key, i = decoder.raw_decode(text, i)
            i = skip(text, skip(text, i) + 1)  # past the ':'
        _, end = decoder.raw_decode(text, i)
        out.append((key, i, end))
        i = skip(text, end)
        i = skip(text, i + 1) if text[i] == "," else i
    return out


def skip(text: str, i: int) -> int:
    """The first index from ``i`` that is not JSON whitespace."""
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def call_at(text: str, start: int, end: int, key: str) -> Call | None:
    """The JSON value text[start:end] as a call, or None when it is not one: an object with a
    string name and an object of arguments (some models write the arguments as a JSON string of
    an object). The arguments are their text as the model wrote it, so a streamed call
    (call_stream.py) and a whole one are the same text."""
    value = json.loads(text[start:end])
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    # The arguments' key must be there: {"name": "Bob", "age": 3} is an answer, not a call.
    found = next((k for k in (key, "arguments", "parameters") if k in value), None)
    if found is None:
        return None
    spans = {k: (s, e) for k, s, e in children(text, start)}  # a repeated key: the last, as json.loads
    args, raw = value[found], text[slice(*spans[found])]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
        raw = json.dumps(args, ensure_ascii=False)
    return Call(value["name"], raw) if isinstance(args, dict) else None


def json_values(text: str, separator: str) -> list[tuple[object, int, int]] | None:
    """The JSON values of ``text`` (each with its start and end) written one after another with
    ``separator`` (and any whitespace) between them, or None when anything else is there."""
    decoder, values, i, sep = json.JSONDecoder(), [], 0, separator.strip()
    while True:
        i = skip(text, i)
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append((value, i, end))
        i = skip(text, end)
        if i == len(text):
            return values
        if not sep or not text.startswith(sep, i):
            return None
        i += len(sep)


def calls_of(text: str, spans, key: str) -> list[Call] | None:
    """The values at ``spans`` ((start, end) in ``text``) as calls, or None unless all are calls."""
    calls = [call_at(text, start, end, key) for start, end in spans]
    return None if not calls or None in calls else calls


HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> tuple[str, list[Call]]:
    blocks = list(HERMES_BLOCK.finditer(text))
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        values = json_values(block.group(1), "")
        found = None
        if values is not None and len(values) == 1:
            found = calls_of(block.group(1), [values[0][1:]], FORMATS["hermes"].key)
        if found is None:
            return text, []  # a broken block: the text is the model's, unparsed
        calls += found
    content = HERMES_BLOCK.sub("", text)
    return ("" if not content.strip() else content.strip()), calls


def parse_llama3(text: str) -> tuple[str, list[Call]]:
    body = text.strip()
    body = body[len(PYTHON_TAG) :] if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    values = json_values(body, ";")
    calls = None if values is None else calls_of(body, [v[1:] for v in values], FORMATS["llama3"].key)
    return ("", calls) if calls else (text, [])


def parse_mistral(text: str) -> tuple[str, list[Call]]:
    head, marker, body = text.partition("[TOOL_CALLS]")
    if not marker:  # the marker was a special token the detokenizer dropped: a bare list of calls
        head, body = "", text
        if not text.lstrip().startswith("[{"):
            return text, []
    values = json_values(body, ",")
    spans = None if values is None else [v[1:] for v in values]
    if values is not None and len(values) == 1 and isinstance(values[0][0], list):
        spans = [(s, e) for _, s, e in children(body, values[0][1])]  # the items of the list
    calls = None if spans is None else calls_of(body, spans, FORMATS["mistral"].key)
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
