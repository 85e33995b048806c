"""Run a module on several ranks on CPU (gloo), bounded in time, leaving no process behind: forked
ranks with torchrun's environment (``start_ranks``, ``ranks``: to the end), or the real torchrun
in the background until stopped (``spawn``, ``stop_session``: its signal handling is what those
tests are about)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import zygote

ROOT = Path(__file__).resolve().parents[2]
GRACE = 30  # s a rank has to end after another rank failed, before SIGKILL (torchrun's default)


def launch_env() -> dict[str, str]:
    """This process's environment with one thread, no native kernels and the checkout on PYTHONPATH."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFORMER_NATIVE": "0", "PYTHONPATH": str(ROOT)}


def start_ranks(n: int, module: str, *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None,
                stdout=None, stderr=None) -> list[zygote.Popen]:  # fmt: skip
    """``python -m module args`` on ``n`` ranks with the environment torchrun gives its workers
    (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR/PORT, ...;
    env:// rendezvous on a free port), started and left running, each in a session of its own as
    torchrun starts them. Forked from zygotes (tests/zygote.py: no torch import per rank), even and
    odd ranks from different ones: rank 0 and rank 1 never share a string-hash seed, as two fresh
    interpreters would not, so an order that differs by seed differs between them. ``env``
    defaults to ``launch_env()``; ``stdout`` / ``stderr`` as for ``zygote.Popen``."""
    with socket.socket() as probe:  # rank 0 hosts the store there (a port free now, as --standalone picks)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = env or launch_env()
    world = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
             "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
             "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
    envs = [{**base, **world, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(n)]
    for rank, rank_env in enumerate(envs[:2]):  # the zygotes start side by side
        zygote.zygote(rank_env, rank)
    return [zygote.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=rank_env, stdin=subprocess.DEVNULL,
                         stdout=stdout, stderr=stderr, start_new_session=True, slot=rank % 2)
            for rank, rank_env in enumerate(envs)]  # fmt: skip


def ranks(n: int, module: str, *args: str, timeout: float = 240, cwd: Path = ROOT,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """``start_ranks`` to the end. As under torchrun the ranks share one stdout and one stderr;
    when a rank fails the others get SIGTERM, then SIGKILL after ``GRACE`` s, and the status is 1.
    Past ``timeout`` s every rank is killed and the launch fails."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        procs = start_ranks(n, module, *args, cwd=cwd, env=env, stdout=out_w, stderr=err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    got: dict[int, str] = {}
    readers = [threading.Thread(target=_read_all, args=(fd, got), daemon=True) for fd in (out_r, err_r)]
    for reader in readers:
        reader.start()
    began, failed_at = time.monotonic(), None
    while None in [p.poll() for p in procs]:  # every rank polled each round (no short circuit)
        now = time.monotonic()
        if now - began > timeout:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
            raise AssertionError(f"ranks of {module} ran past {timeout} s")
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
            for p in procs:
                p.terminate()
        elif failed_at is not None and now - failed_at > GRACE:
            for p in procs:
                p.kill()
        time.sleep(0.02)
    for reader in readers:
        reader.join()
    code = 0 if all(p.returncode == 0 for p in procs) else 1
    return subprocess.CompletedProcess(["ranks", str(n), "-m", module, *args], code, got[out_r], got[err_r])


def _read_all(fd: int, got: dict[int, str]) -> None:
    with open(fd, "rb") as stream:
        got[fd] = stream.read().decode(errors="replace")


def spawn(n: int, module: str, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """``torchrun --standalone --nproc_per_node n -m module args`` (standalone: a free port of its
    own) with ``launch_env()``, left running in a session of its own (stop it with ``stop_session``);
    its stdout and stderr lines are collected as they come."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           "-m", module, *args]  # fmt: skip
    env = {**launch_env(), "PYTHONUNBUFFERED": "1"}
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
