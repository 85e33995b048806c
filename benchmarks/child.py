"""A benchmark's measuring child process: ``python -m <module> --child <json>`` in a fresh
interpreter (its own caches, threads and memory high-water mark), which prints one line
``<marker><json result>`` on stdout."""

from __future__ import annotations

import json
import subprocess
import sys


def run_child(module: str, payload, marker: str, *, env: dict | None = None, timeout: float = 1800.0) -> dict:
    """The JSON after ``marker`` on the child's stdout; RuntimeError with its exit status and the
    tail of its stderr where it printed none."""
    cmd = [sys.executable, "-m", module, "--child", json.dumps(payload)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker) :])
    raise RuntimeError(f"{module}: the measuring process failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
