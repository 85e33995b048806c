"""Issue 4, test 2: a training process killed with SIGKILL while writing a checkpoint leaves the
previous checkpoint loadable, and --resume auto continues from it."""

import signal
import subprocess
import sys
import textwrap

import torchformer as tfm
from torchformer.training.checkpoint import list_checkpoints
from torchformer.training.train import train

from .tiny import tiny_recipe

# Runs training in a child process whose 5th safetensors write (the optimizer file of the second
# checkpoint, after its weights are on disk) kills the process with SIGKILL: no cleanup runs.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from tests.training.tiny import tiny_recipe
    from torchformer import atomic
    from torchformer.training.train import train

    real, calls = atomic.save_file, []
    def save_then_die(*args, **kwargs):
        calls.append(1)
        real(*args, **kwargs)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGKILL)
    atomic.save_file = save_then_die
    train(tiny_recipe({out!r}, {corpus!r}, train={{"steps": 20, "checkpoint_every": 5}}))
    """
)


def test_sigkill_during_checkpoint_write(tmp_path, corpus):
    out = tmp_path / "run"
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    script = CHILD.format(root=root, out=str(out), corpus=str(corpus))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [p.name for p in list_checkpoints(out)] == ["step_000005"]
    assert list((out / "checkpoints").glob(".tmp_step_000010.*"))  # the half-written one, hidden
    for folder in (out / "checkpoints" / "step_000005", out):  # both open with tfm.load
        model = tfm.load(folder)
        assert model.config.n_layers == 2
    resumed = train(tiny_recipe(out, corpus, train={"steps": 20, "checkpoint_every": 5}), resume="auto")
    assert resumed.step == 20
    assert [p.name for p in list_checkpoints(out)] == ["step_000015", "step_000020"]  # keep_last=2
    assert not list((out / "checkpoints").glob(".tmp_*"))
    assert [row["step"] for row in resumed.metrics] == [0, 10, 20]
