"""Reads the site's pages into the examples the tests run (tests/docs/test_examples.py).

A page is a sequence of fenced blocks. ```python blocks run in one namespace per page (like a
notebook), ```bash blocks in bash with the project's venv first on PATH; both in one scratch
folder per page, in page order. A page may say how the tests run it, in HTML comments that the
site does not show:

- ``<!-- test: needs demo -->`` / ``<!-- test: needs reverse -->`` (anywhere): the page's folder
  starts with a shrunk `torchformer demo` run in runs/shakespeare-char (or `demo reverse` in
  runs/reverse), as `make demo` would leave it.
- ``<!-- test: append WORDS -->`` before a block: WORDS are appended to each of its
  `torchformer train|demo` lines (the shrinking the page's text mentions: `train.steps=3 ...`).
- ``<!-- test: server -->`` before a block of one `torchformer serve` line: started in the
  background on a free port (``--port 0`` appended); the later blocks' ``127.0.0.1:8000`` is
  replaced with its address; stopped at the end of the page.
- ``<!-- test: setup ... -->`` before a block: hidden Python run first, in the page namespace
  (inputs the text assumes, e.g. a tiny Hugging Face folder at the path the example names).
- ``<!-- test: skip REASON -->`` before a block: illustrative only (counted; kept few).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
RUNNABLE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
TOKEN = re.compile(
    r"<!-- test: (?P<kind>needs|append|server|setup|skip)\b(?P<arg>.*?)-->"
    r"|^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```",
    flags=re.DOTALL | re.MULTILINE,
)


@dataclass
class Block:
    lang: str  # "python" | "bash"
    code: str
    line: int  # 1-based line of the opening fence
    append: str = ""
    server: bool = False
    setup: str = ""
    skip: str = ""  # the reason, when illustrative


@dataclass
class Page:
    path: Path
    needs: set[str] = field(default_factory=set)
    blocks: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(DOCS)) if self.path.is_relative_to(DOCS) else self.path.name


def pages() -> list[Page]:
    return [read(path) for path in sorted(DOCS.rglob("*.md"))]


def read(path: Path) -> Page:
    text = path.read_text()
    page, pending = Page(path), {}
    for m in TOKEN.finditer(text):
        if m.group("kind"):
            kind, arg = m.group("kind"), m.group("arg").strip()
            if kind == "needs":
                page.needs.update(arg.split())
            else:
                pending[kind] = arg if kind != "server" else True
            continue
        lang = RUNNABLE.get(m.group("lang"))
        if lang is None:  # text, output listings, yaml, ...: shown, not run
            if pending:
                raise ValueError(f"{page.name}: a test directive precedes a ```{m.group('lang')} block")
            continue
        line = text.count("\n", 0, m.start()) + 1
        page.blocks.append(Block(lang, m.group("code"), line, **pending))
        pending = {}
    if pending:
        raise ValueError(f"{page.name}: test directive {sorted(pending)} after the last block")
    return page


def shrunk(code: str, words: str) -> str:
    """``words`` appended to each `torchformer train|demo` command line of ``code``."""
    if not words:
        return code
    out = []
    for line in code.splitlines():
        command, sep, comment = line.partition(" #")
        if re.search(r"(^\s*torchformer |-m torchformer\.cli\.main )(train|demo)\b", command):
            line = f"{command.rstrip()} {words}" + (f"  #{comment}" if sep else "")
        out.append(line)
    return "\n".join(out) + "\n"
