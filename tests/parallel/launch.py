"""Run a module under torchrun on CPU (gloo), bounded in time, leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
