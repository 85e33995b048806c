"""Run a module under torchrun on CPU (gloo), bounded in time, leaving no process behind: to its end
(``torchrun``), or in the background until stopped (``spawn``, ``stop_session``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun(n: int, module: str, *args: str, timeout: float = 240, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node n -m module args`` (standalone: a free port of its
    own); the whole process group is killed if it runs past ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           "-m", module, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFORMER_NATIVE": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun {module} ran past {timeout} s: {err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def spawn(n: int, module: str, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """``torchrun`` as ``torchrun`` above, left running in a session of its own (stop it with
    ``stop_session``); its stdout and stderr lines are collected as they come."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           "-m", module, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFORMER_NATIVE": "0", "PYTHONPATH": str(ROOT),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...), None once the process is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def family(pid: int) -> list[int]:
    """``pid`` (torchrun) and its children (the ranks: each in a session of its own), while alive."""
    children = [
        int(p.parent.name)
        for p in Path("/proc").glob("[0-9]*/stat")
        if (_stat(int(p.parent.name)) or [0, 0])[1] == str(pid)
    ]
    return [p for p in [pid, *children] if _stat(p) is not None]


def rank_pid(pid: int, rank: int) -> int:
    """The process of ``rank`` among torchrun ``pid``'s children (its environment says RANK)."""
    for child in family(pid)[1:]:
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:  # an exact entry (LOCAL_RANK=1 is another)
            return child
    raise AssertionError(f"no process of rank {rank} under torchrun {pid}")


def stop_session(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> float:
    """Send ``sig`` to torchrun, wait until it and every rank it started have exited (SIGKILL to
    all of them past ``timeout`` s, then fail); returns the seconds that took."""
    began, pids = time.monotonic(), family(proc.pid)
    if proc.poll() is None:
        proc.send_signal(sig)
    alive = lambda: [p for p in pids if _stat(p) is not None and (p != proc.pid or proc.poll() is None)]  # noqa: E731
    while alive() and time.monotonic() - began < timeout:
        time.sleep(0.1)
    left = alive()
    for p in left:
        with contextlib.suppress(ProcessLookupError):  # it may have exited meanwhile
            os.kill(p, signal.SIGKILL)
    proc.wait(timeout=10)
    assert len(pids) > 1, f"torchrun {proc.pid} had no ranks when it was stopped"
    assert not left, f"processes {left} of torchrun were still alive {timeout} s after it was stopped"
    return time.monotonic() - began
