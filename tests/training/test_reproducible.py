"""Issue 10: exact reproducibility and resume through the real command, at the thread count users run
with (2 threads, torch's default on these machines; the in-process suite runs at 1 and cannot see
thread-order bugs). Every run is `python -m torchformer.cli.main train` in a child process of its
own: the reference run a fresh interpreter, the others forked from a zygote that has imported torch
and torchformer (tests/zygote.py; another string-hash seed than the reference's, as another
interpreter would have); two-rank runs get torchrun's environment (tests/parallel/launch.py); kills
are SIGKILL, so no cleanup code runs.

Equal means bit-equal: model.safetensors, optimizer.safetensors and rng.safetensors of the final
checkpoint, and every metrics row except elapsed_s (wall-clock time).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torchformer.training.checkpoint import list_checkpoints
from torchformer.training.train import train

from .. import zygote
from ..parallel.launch import ranks, start_ranks
from .tiny import tiny_recipe, tiny_seq2seq, words_text

THREADS = "2"
STEPS = 12
CKPT = 2
ROOT = Path(__file__).resolve().parents[2]
# Checkpoints every 2 steps, evaluations every 3: a resume point is often inside a loss window.
SCHEDULE = {"steps": STEPS, "checkpoint_every": CKPT, "eval_every": 3, "keep_last": 2, "log_every": 5, "batch_size": 16}
# Wide enough that 2-thread kernels split their work: at d_model 32 two runs agree even without
# train.deterministic; at 64 (T 32, B 16) they differ by ~1e-7 after 30 steps, and already after
# these 12 (measured: weights 6e-8 and every Adam moment apart with train.deterministic=false).
WIDTH = {"d_model": 64, "max_seq_len": 32}
# The real CLI, with the n-th safetensors write (n from argv) followed by SIGKILL: a death in the
# middle of writing a checkpoint folder, after some of its files are on disk.
DIE_IN_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    from torchformer import atomic
    from torchformer.cli.main import main

    real, calls, die_at = atomic.save_file, [], int(sys.argv[1])
    def save_then_die(*args, **kwargs):
        calls.append(1)
        real(*args, **kwargs)
        if len(calls) == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
    atomic.save_file = save_then_die
    sys.exit(main(sys.argv[2:]))
    """
)


def recipe_file(tmp: Path, name: str, kind: str, corpus: Path, **train_opts) -> Path:
    out = tmp / name
    if kind == "decoder":  # dropout on: the restored RNG state matters
        model = {**WIDTH, "dropout": 0.1, "block": {"dropout": 0.1}}
        recipe = tiny_recipe(out, corpus, model=model, data={"seq_len": 32}, train=train_opts)
    else:  # the encoder-decoder recipe shape, with gradient accumulation and dropout
        recipe = tiny_seq2seq(out, model=WIDTH, train={"grad_accum": 2, **train_opts})
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(recipe.to_dict()))
    return path


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": THREADS, "PYTHONPATH": str(ROOT / "src")}


def cli(recipe: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torchformer.cli.main", "train", "--recipe", str(recipe), *extra]


def finish(cmd: list[str], cwd: Path, fresh: bool = False) -> None:
    """Run ``cmd`` to its end: forked from the zygote, or a fresh interpreter if ``fresh``."""
    proc = (subprocess if fresh else zygote).run(cmd, capture_output=True, text=True, timeout=300, env=env(), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]


def start(cmd: list[str], cwd: Path) -> list[zygote.Popen]:
    """The command in a session of its own, its stderr in a file (read if it fails)."""
    with open(cwd / "killed.err", "w") as err:
        return [zygote.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)]


def kill_after_checkpoint(procs: list[zygote.Popen], run: Path, step: int, log: Path | None = None) -> None:
    """SIGKILL every process of a run (its one process, or its ranks) as soon as checkpoint ``step``
    (or a later one) is complete: they are then somewhere in the steps after it. Each rank is killed
    itself (each runs in a session of its own), so none is left to finish the run alone and make
    the resume prove nothing."""
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and None in [p.poll() for p in procs]:
            done = list_checkpoints(run)
            if done and int(done[-1].name.split("_")[1]) >= step:
                for p in procs:
                    os.kill(p.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = log.read_text()[-2000:] if log and log.exists() else ""
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * len(procs), f"the run ended before its kill: {said}"
    assert not (run / "checkpoints" / f"step_{STEPS:06d}").exists()


def assert_same_run(a: Path, b: Path) -> None:
    last = f"checkpoints/step_{STEPS:06d}"
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
        x, y = load_file(str(a / last / name)), load_file(str(b / last / name))
        assert x.keys() == y.keys(), name
        for key in x:
            assert torch.equal(x[key], y[key]), f"{name}: {key} differs"
    lines = [(r / "metrics.jsonl").read_text().splitlines() for r in (a, b)]
    rows = [[{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in run] for run in lines]
    assert rows[0] == rows[1]
    assert [r["step"] for r in rows[0]] == [0, 3, 6, 9, 12]


# One worker: the straight reference run (a module fixture) is trained once, not once per xdist worker.
pytestmark = pytest.mark.xdist_group("reproducible")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(words_text(400))
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """The decoder recipe run once, uninterrupted: the reference the other decoder runs must equal."""
    tmp = tmp_path_factory.mktemp("straight")
    finish(cli(recipe_file(tmp, "run", "decoder", corpus, **SCHEDULE)), tmp, fresh=True)
    return tmp / "run"


def test_two_straight_runs_are_bit_equal(tmp_path, corpus, straight):
    finish(cli(recipe_file(tmp_path, "again", "decoder", corpus, **SCHEDULE)), tmp_path)
    assert_same_run(straight, tmp_path / "again")


@pytest.mark.parametrize("kind", ["decoder", "encoder_decoder"])
def test_killed_and_resumed_equals_straight(tmp_path, corpus, straight, kind):
    rng = random.Random(f"issue-10-{kind}")
    if kind == "encoder_decoder":
        finish(cli(recipe_file(tmp_path, "straight", kind, corpus, **SCHEDULE)), tmp_path, fresh=True)
        straight = tmp_path / "straight"
    killed = recipe_file(tmp_path, "killed", kind, corpus, **SCHEDULE)
    # Killed after checkpoint 2, 4 or 6: at least 6 steps and two evaluations still to run.
    step = rng.randrange(CKPT, STEPS - 2 * CKPT, CKPT)
    kill_after_checkpoint(start(cli(killed), tmp_path), tmp_path / "killed", step, tmp_path / "killed.err")
    finish(cli(killed, "--resume", "auto"), tmp_path)
    assert_same_run(straight, tmp_path / "killed")


def test_killed_while_writing_a_checkpoint_then_resumed_equals_straight(tmp_path, corpus, straight):
    killed = recipe_file(tmp_path, "killed", "decoder", corpus, **SCHEDULE)
    # Three safetensors files per checkpoint (weights, optimizer, rng); die after one of the first
    # two files of a checkpoint in the middle of the run.
    die_at = 3 * random.Random("issue-10-write").randrange(1, 5) + random.Random("issue-10-file").choice([1, 2])
    proc = zygote.run([sys.executable, "-c", DIE_IN_WRITE, str(die_at), *cli(killed)[3:]], capture_output=True,
                      text=True, timeout=300, env=env(), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert list((tmp_path / "killed" / "checkpoints").glob(".tmp_step_*"))  # the half-written folder, hidden
    finish(cli(killed, "--resume", "auto"), tmp_path)
    assert_same_run(straight, tmp_path / "killed")


def test_two_process_ddp_with_dropout_killed_and_resumed_equals_straight(tmp_path, corpus):
    opts = {**SCHEDULE, "threads": 1}  # 2 ranks x 1 thread on 2 cores, as torchrun sets
    straight = recipe_file(tmp_path, "straight", "decoder", corpus, **opts)
    killed = recipe_file(tmp_path, "killed", "decoder", corpus, **opts)

    def launch(recipe: Path, *extra: str) -> None:  # two ranks with torchrun's environment, to the end
        done = ranks(2, "torchformer.cli.main", "train", "--recipe", str(recipe), *extra, cwd=tmp_path, env=env(),
                     timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]

    launch(straight)
    step = random.Random("issue-10-ddp").choice([2, 4, 6])
    procs = start_ranks(2, "torchformer.cli.main", "train", "--recipe", str(killed), cwd=tmp_path, env=env(),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    kill_after_checkpoint(procs, tmp_path / "killed", step)  # both ranks: none finishes the run on its own
    launch(killed, "--resume", "auto")
    assert_same_run(tmp_path / "straight", tmp_path / "killed")
    rng = load_file(str(tmp_path / "killed" / f"checkpoints/step_{STEPS:06d}" / "rng.safetensors"))
    assert set(rng) == {"cpu", "cpu.rank1"} and not torch.equal(rng["cpu"], rng["cpu.rank1"])


@pytest.mark.parametrize("setting", [False, True, None])
def test_the_setting_reaches_torch_and_is_given_back(tmp_path, corpus, setting, monkeypatch):
    seen = []
    import torchformer.training.train as train_module

    real = train_module.build_model

    def spy(cfg):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(cfg)

    monkeypatch.setattr(train_module, "build_model", spy)
    before = torch.are_deterministic_algorithms_enabled()
    result = train(tiny_recipe(tmp_path / "run", corpus, train={"steps": 2, "deterministic": setting}))
    assert seen == [setting is not False]  # None: on, for CPU
    assert torch.are_deterministic_algorithms_enabled() == before
    state = json.loads((result.out_dir / "checkpoints/step_000002/state.json").read_text())
    assert state["run"] == {"deterministic": setting is not False, "threads": torch.get_num_threads(), "world": 1}


def test_resuming_with_another_setting_warns(tmp_path, corpus):
    train(tiny_recipe(tmp_path / "run", corpus, train={"steps": 4}), stop_after=2)
    with pytest.warns(UserWarning, match=r"deterministic True -> False .* not bit-identical"):
        train(tiny_recipe(tmp_path / "run", corpus, train={"steps": 4, "deterministic": False}), resume="auto")
