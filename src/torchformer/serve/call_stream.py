"""Streaming one chat choice whose answer may hold tool calls (tool_formats.py's formats): calls
go out as the model writes them, as vLLM streams them. A call's first chunk is its index, id
and function name, sent once the head of the call (its name, then its arguments' key) has been
written; then each piece of its arguments' text as it comes, until the arguments' object closes.
The openai client joins the pieces; the whole text is what the non-streamed answer reports
(tool_formats.call_at keeps the arguments as the model wrote them).

Text that cannot begin a call is sent as content at once; text that may (a marker, or its start
cut off at the end of the text so far) is held until it is a call's head or certainly not one.
A call whose head is in another order (arguments before name, arguments as a JSON string) is
held whole and parsed when it ends (hermes: at ``</tool_call>``; the others: at the end of the
choice), as before streaming; so is anything after a call that is not the next call.

A call already sent cannot be taken back: a streamed answer that breaks off after a call has
begun (``finish_reason: length``, or text that is not valid JSON) keeps what was sent, where the
non-streamed parse would report the whole answer as content.
"""

from __future__ import annotations

from .tool_formats import PYTHON_TAG, Call, call_id, parse

# A call's head, piece by piece: a literal, "?literal" (optional), " " (any whitespace), "{" (the
# call object opens: its position is kept), '"' (a JSON string: the name), "key" (the arguments'
# key), "(" (the arguments' object opens next: matched, not consumed).
HEAD = ["{", " ", '"name"', " ", ":", " ", '"', " ", ",", " ", "key", " ", ":", " ", "("]
FIRST = {  # the first call; the index after which a mismatch holds the text (it began as a call)
    "hermes": (["<tool_call>", " ", *HEAD], 1),
    "llama3": ([" ", "?" + PYTHON_TAG, " ", *HEAD], 4),
    "mistral": (["?[TOOL_CALLS]", " ", "[", " ", *HEAD], 4),
}
NEXT = {  # each later call, after the one before has closed
    "hermes": ([" ", "<tool_call>", " ", *HEAD], 2),
    "llama3": ([" ", ";", " ", *HEAD], 3),
    "mistral": ([" ", ",", " ", *HEAD], 3),
}
AFTER = {"hermes": [" ", "</tool_call>"], "llama3": [], "mistral": []}  # after a call's object closes
KEYS = ('"arguments"', '"parameters"')
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def match(pieces: list[str], text: str, i: int) -> tuple[str, int, dict]:
    """Match ``pieces`` at text[i:]: ("match", end, captures), ("partial", i, {}) when the text
    ends before a mismatch, or ("fail", index of the piece that failed, {})."""
    got: dict = {}
    for n, piece in enumerate(pieces):
        if piece == " ":
            while i < len(text) and text[i] in " \t\n\r":
                i += 1
            continue
        if i == len(text):
            return "partial", i, {}
        if piece == "(":
            if text[i] != "{":
                return "fail", n, {}
            got["args"] = i
        elif piece == "{":
            if text[i] != "{":
                return "fail", n, {}
            got["object"], i = i, i + 1
        elif piece == '"':
            end = string_end(text, i)
            if end is None:
                return ("partial", i, {}) if text[i] == '"' else ("fail", n, {})
            got["name"], i = text[i + 1 : end - 1], end
        else:
            options = KEYS if piece == "key" else (piece.lstrip("?"),)
            hit = next((o for o in options if text.startswith(o, i)), None)
            if hit is not None:
                i += len(hit)
            elif any(o.startswith(text[i:]) for o in options):
                return "partial", i, {}
            elif not piece.startswith("?"):
                return "fail", n, {}
    return "match", i, got


def string_end(text: str, i: int) -> int | None:
    """The end of the JSON string that starts at text[i] ('"'), or None while it is unfinished."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


class CallStream:
    """One choice's text in, (content to send, tool_calls deltas) out (module docstring)."""

    def __init__(self, fmt: str) -> None:
        self.fmt, self.text, self.pos = fmt, "", 0  # text[:pos] is sent (as content or as calls)
        self.mode = "content"  # content | call (its arguments, then its end) | between | held
        self.calls = 0  # calls begun
        self.plain = False  # the answer did not open as a call (llama3; a bare mistral list)
        self.depth = 0  # inside the call object: JSON nesting (brackets in strings are not)
        self.string = self.escape = False  # inside a JSON string; after its backslash
        self.args_end: int | None = None
        self.sent_args = 0  # the arguments' text sent up to here
        self.held: int | None = None  # mode held: from here, parsed whole later

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and the tool_calls deltas that can be sent now."""
        self.text += text
        content, deltas = [], []
        while self.step(content, deltas):
            pass
        return "".join(content), deltas

    def end(self) -> tuple[str, list[dict]]:
        """What is still to send once the choice has ended: held text parsed whole."""
        content, deltas = [], []
        rest = self.text[self.pos :]
        if self.mode in ("content", "between", "held") and rest:
            text, calls = parse(rest, self.fmt)
            for call in calls:
                deltas += self.whole(call)
            if self.mode == "between" or calls:
                text = text.strip()  # the space between or after calls is not content
            content.append(text)
        self.pos = len(self.text)
        return "".join(content), deltas

    # --- one step at a time: True when it moved on and another may follow ------------------
    def step(self, content: list[str], deltas: list[dict]) -> bool:
        if self.mode == "call":
            return self.call(deltas)
        if self.mode == "held":
            return self.held_block(deltas)
        if self.mode == "between":
            return self.between(content, deltas)
        start = self.call_start()
        if start > self.pos:
            content.append(self.text[self.pos : start])
            self.pos = start
        if self.pos == len(self.text):
            return False
        pieces, commit = FIRST[self.fmt]
        status, at, got = match(pieces, self.text, self.pos)
        if status == "match":
            return self.open(got, deltas)
        if status == "partial":
            return False
        if at > commit:  # it began as a call: parsed whole when it ends
            self.mode, self.held = "held", self.pos
            return True
        if self.pos == 0 and self.fmt != "hermes":
            self.plain = True  # llama3 / a bare mistral list: only an answer that opens as a call is one
        content.append(self.text[self.pos])  # not a call here: a character of content
        self.pos += 1
        return True

    def call_start(self) -> int:
        """Where a call may begin at or after pos (len(text): nowhere yet)."""
        text, pos = self.text, self.pos
        if self.fmt == "llama3" or (self.fmt == "mistral" and pos == 0 and not self.plain):
            if pos == 0 and not self.plain:
                body = text.lstrip()
                if self.fmt == "llama3" and (body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body)):
                    return 0
                if self.fmt == "mistral" and "[{".startswith(body[:2]):
                    return 0
            if self.fmt == "llama3":
                return len(text)
        marker = MARKERS[self.fmt]
        found = text.find(marker, pos)
        if found >= 0:
            return found
        for cut in range(min(len(marker) - 1, len(text) - pos), 0, -1):
            if marker.startswith(text[-cut:]):
                return len(text) - cut
        return len(text)

    def open(self, got: dict, deltas: list[dict]) -> bool:
        """A call's head is in: its first delta (index, id, name); its arguments stream next."""
        head = {"index": self.calls, "id": call_id(), "type": "function"}
        deltas.append({**head, "function": {"name": got["name"], "arguments": ""}})
        self.calls += 1
        self.mode, self.depth, self.args_end, self.string, self.escape = "call", 1, None, False, False
        self.pos = self.sent_args = got["args"]
        return True

    def call(self, deltas: list[dict]) -> bool:
        """Scan the call object from pos: the arguments' text as it comes, then the object's end."""
        text, i = self.text, self.pos
        while i < len(text) and self.depth > 0:
            ch = text[i]
            if self.string:  # inside a JSON string: brackets are text
                self.string = self.escape or ch != '"'
                self.escape = not self.escape and ch == "\\"
            elif ch == '"':
                self.string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self.args_end is None:  # the arguments' object has closed
                    self.args_end = i + 1
            i += 1
        self.pos = i
        upto = min(i, self.args_end or i)
        if upto > self.sent_args:
            deltas.append({"index": self.calls - 1, "function": {"arguments": text[self.sent_args : upto]}})
            self.sent_args = upto
        if self.depth > 0:
            return False
        status, end, _ = match(AFTER[self.fmt], text, self.pos)
        if status == "partial":
            return False
        if status == "match":
            self.pos = end
        self.mode = "between"
        return True

    def between(self, content: list[str], deltas: list[dict]) -> bool:
        """After a call: the next call's head, the end of the list (mistral), or content."""
        pieces, commit = NEXT[self.fmt]
        status, at, got = match(pieces, self.text, self.pos)
        if status == "match":
            return self.open(got, deltas)
        if status == "partial":
            return False
        if at > commit:
            self.mode, self.held = "held", self.pos
            return True
        if self.fmt == "mistral":
            status, end, _ = match([" ", "]"], self.text, self.pos)
            if status == "partial":
                return False
            self.pos = end if status == "match" else self.pos
        self.mode = "content"  # the rest is content (whitespace right after a call is dropped)
        rest = self.text[self.pos :]
        self.pos += len(rest) - len(rest.lstrip())
        return True

    def held_block(self, deltas: list[dict]) -> bool:
        """hermes: a held block is parsed once its </tool_call> is in; the others wait for end()."""
        close = self.text.find("</tool_call>", self.held) if self.fmt == "hermes" else -1
        if close < 0:
            return False
        end = close + len("</tool_call>")
        _, calls = parse(self.text[self.held : end], self.fmt)
        if not calls:  # a broken block stays held: end() gives it as content
            return False
        for call in calls:
            deltas += self.whole(call)
        self.pos, self.mode = end, "between"
        return True

    def whole(self, call: Call) -> list[dict]:
        """A call parsed whole: its head, then all its arguments."""
        head = {"index": self.calls, "id": call_id(), "type": "function"}
        self.calls += 1
        return [
            {**head, "function": {"name": call.name, "arguments": ""}},
            {"index": head["index"], "function": {"arguments": call.arguments}},
        ]
