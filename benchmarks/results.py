"""benchmarks/RESULTS.md: each benchmark owns one section between HTML-comment markers and
rewrites only that section, so the file always holds every benchmark's latest table."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(key: str, title: str, command: str, setting: str, text: str) -> None:
    """Replace (or append) the ``key`` section: title, the command and when/where it ran, the table."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = (
        f"{start}\n## {title}\n\n`{command}` ({stamp}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; {setting})\n\n{text}\n{end}"
    )
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if start in old:
        new = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: body, old, flags=re.S)
    else:
        new = old.rstrip("\n") + "\n\n" + body + "\n"
    RESULTS.write_text(new)


def load_note(load: tuple[float, float, float]) -> str:
    """'load average before the run a, b, c': how busy the machine was (a busy one skews every number)."""
    return "load average before the run " + ", ".join(f"{x:.1f}" for x in load)
