"""The default run's ablation: validation loss against training CPU time for recipe variants of
`make demo` (shakespeare-char), each in its own one-thread process.

Wall-clock is meaningless on a shared 2-core machine, so each variant trains with one torch
thread and the loop's clock reads the main thread's CPU time (every step's work runs on it):
``elapsed_s`` in its metrics rows is then CPU seconds of training. The loss at a step does not
depend on the machine (seeded, deterministic), so the table holds the loss each variant reaches
and the CPU seconds it paid. ``--wall-ms-per-cpu-s`` converts CPU seconds into the demo's 2-thread
wall-clock, from one measured pair (a quiet `torchformer demo` run of the same recipe).

    python -m benchmarks.demo_recipe --variants baseline muon new
    python -m benchmarks.demo_recipe --list
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

OLD = "shakespeare-char-2020"  # the recipe the demo trained before (the baseline)
NEW = "shakespeare-char"

MUON = ["optim.name=muon", "train.steps=900"]  # ~ the 75 s budget: Muon's step costs ~1.3x AdamW's
M600 = ["optim.name=muon", "train.steps=600"]  # second session: ~2/3 of the 850-step recipe's time
LR2X = ["optim.muon_lr=0.04", "optim.lr=6e-3"]
LR3X = ["optim.muon_lr=0.06", "optim.lr=9e-3"]
QK = "model.attention.qk_norm=head"
VARIANTS: dict[str, tuple[str, list[str]]] = {  # name -> (recipe, overrides)
    "baseline": (OLD, []),
    "muon-1000": (OLD, ["optim.name=muon"]),
    "muon": (OLD, MUON),
    "muon+qknorm": (OLD, [*MUON, QK]),
    "muon+untied": (OLD, [*MUON, "model.tie_embeddings=false"]),
    "muon+softcap": (OLD, [*MUON, "model.final_softcap=30"]),
    "muon+rope": (OLD, [*MUON, "model.positions.kind=rope"]),
    "muon+rmsnorm": (OLD, [*MUON, "model.block.norm=rmsnorm"]),
    "muon+lr2x": (OLD, [*MUON, *LR2X]),
    "muon-850": (OLD, ["optim.name=muon", "train.steps=850"]),  # the first session's shakespeare-char
    "m600": (OLD, M600),
    "m600+wsd": (OLD, [*M600, "schedule.name=wsd", "schedule.decay_fraction=0.5", "schedule.min_ratio=0"]),
    "m600+lr2x": (OLD, [*M600, *LR2X]),
    "m600+lr3x": (OLD, [*M600, *LR3X]),
    "m600+lr2x+relu": (OLD, [*M600, *LR2X, "model.block.mlp=relu"]),
    "m600+lr2x+wd0": (OLD, [*M600, *LR2X, "optim.weight_decay=0"]),
    "m600+lr2x+wd0.2": (OLD, [*M600, *LR2X, "optim.weight_decay=0.2"]),
    "m600+lr2x+qknorm": (OLD, [*M600, *LR2X, QK]),
    "m400-b32": (OLD, ["optim.name=muon", "train.steps=400", "train.batch_size=32"]),
    "m350-b32+lr2x": (OLD, ["optim.name=muon", "train.steps=350", "train.batch_size=32", *LR2X]),
    "m350-b32+lr3x": (OLD, ["optim.name=muon", "train.steps=350", "train.batch_size=32", *LR3X]),
    "m680+lr2x+qknorm": (OLD, ["optim.name=muon", "train.steps=680", *LR2X, QK]),
    "m680+lr2x+qknorm+warmup20": (OLD, ["optim.name=muon", "train.steps=680", *LR2X, QK, "schedule.warmup=20"]),
    "m680+qknorm+lr2x+adamw-lr4x": (
        OLD,
        ["optim.name=muon", "train.steps=680", "optim.muon_lr=0.04", "optim.lr=1.2e-2", QK],
    ),
    "m650+lr2x+qknorm+warmup100": (OLD, ["optim.name=muon", "train.steps=650", *LR2X, QK, "schedule.warmup=100"]),
    "m400-b32+lr2x+qknorm": (OLD, ["optim.name=muon", "train.steps=400", "train.batch_size=32", *LR2X, QK]),
    "m400-b32+lr3x+qknorm": (OLD, ["optim.name=muon", "train.steps=400", "train.batch_size=32", *LR3X, QK]),
    "new": (NEW, []),
}


def run_one(recipe: str, overrides: list[str]) -> list[dict]:
    """Train in this process on one thread with the loop's clock on thread CPU time; the metrics rows."""
    import torch

    torch.set_num_threads(1)
    from torchformer.training import train as train_module
    from torchformer.training.recipe import load

    train_module.time = SimpleNamespace(perf_counter=time.thread_time)  # the loop's clock: this thread's CPU
    with tempfile.TemporaryDirectory() as out:
        r = load(recipe, [*overrides, f"train.out_dir={out}", "train.max_time_s=null", "train.sample_chars=0"])
        cpu0 = time.thread_time()
        result = train_module.train(r)
    if result.metrics[-1]["elapsed_s"] > time.thread_time() - cpu0 + 1:  # the patch above did not take
        raise RuntimeError("the training loop's clock is not this thread's CPU time: it no longer reads "
                           "torchformer.training.train.time.perf_counter; update run_one")  # fmt: skip
    return result.metrics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--set", nargs="*", default=[], help="overrides added to every variant, e.g. train.steps=300")
    p.add_argument("--list", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child: NAME, prints its metrics rows as JSON
    p.add_argument("--wall-ms-per-cpu-s", type=float, default=None, help="2-thread wall ms per CPU s (from a demo run)")
    args = p.parse_args(argv)
    if args.list:
        for name, (recipe, overrides) in VARIANTS.items():
            print(f"{name:18s} {recipe} {' '.join(overrides)}")
        return 0
    if args.one:
        recipe, overrides = VARIANTS[args.one]
        print(json.dumps(run_one(recipe, [*overrides, *args.set])))
        return 0
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants {unknown}: choose from {list(VARIANTS)}")
    wall = args.wall_ms_per_cpu_s
    head = "| variant | steps | val loss | train CPU s (1 thread) | CPU ms / step |"
    print(head + (" est. demo s |" if wall else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|" if wall else ""))
    for name in args.variants:
        cmd = [sys.executable, "-m", "benchmarks.demo_recipe", "--one", name, "--set", *args.set]
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
        if done.returncode:
            print(f"| {name} | failed: {done.stderr.strip().splitlines()[-1]} |")
            continue
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        last = rows[-1]
        cpu = last["elapsed_s"]
        line = f"| {name} | {last['step']} | {last['val_loss']:.4f} | {cpu:.1f} | {1000 * cpu / last['step']:.1f} |"
        if args.wall_ms_per_cpu_s:
            line += f" {cpu * args.wall_ms_per_cpu_s / 1000:.0f} |"
        print(line, flush=True)
        Path(f"/tmp/demo_recipe_{name}.json").write_text(json.dumps(rows))
    return 0


def _env() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFORMER_NATIVE": "0"}


if __name__ == "__main__":
    sys.exit(main())
