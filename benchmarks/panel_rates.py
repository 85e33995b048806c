"""GB/s of the quantized kernels per panel type and row count, on the engines benchmark's 1B
models (issues 25 and 29): our int4 g64 (from the bf16 folder), and llama.cpp's Q4_K_M and Q8_0
files as loaded (Q4_K -> Int4MinPanels, Q6_K -> Int8Panels6, Q8_0 -> Int8Panels8). Per type: the
bytes of its panels and scales over the time of all its projections' products at R rows, --threads
threads (2; 1 reads what one core can), best of --reps passes, and its share of the machine's plain
read at the same threads measured just before (so rows of different moments compare). Each round
is a fresh process; with --against a second source tree (a checkout of another commit's src/, whose
kernels build there once) the rounds alternate between the two, so a side-by-side reads the same
minutes of the host's memory bandwidth (which moves by a third over minutes on the project's
machines): medians and ranges over the rounds.

    python -m benchmarks.panel_rates --rounds 4
    python -m benchmarks.panel_rates --rows 1 --threads 1 --rounds 3
    git worktree add /tmp/head HEAD~1 && python -m benchmarks.panel_rates --against /tmp/head/src
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.child import run_child

RESULT = "PANEL-RATES "
PLAIN_BYTES = 800_000_000  # the plain read's buffer: about a 4-bit 1B model's step
MODELS = ("int4", "Q4_K_M", "Q8_0")


def measure(rows: list[int], reps: int, threads: int = 2) -> dict[str, list[float]]:
    """In the child: {"model/type/R<rows>": [GB/s, the plain read's GB/s just before]} over the
    loaded models' panel projections, ``threads`` threads for both (1: what one core reads)."""
    import torch

    import torchformer as tfm
    from benchmarks import engines
    from benchmarks.decode import streaming_reader
    from benchmarks.step_cpu import panel_bytes, projections

    torch.set_num_threads(threads)
    plain = streaming_reader(PLAIN_BYTES)
    out = {}
    for name in MODELS:
        if name == "int4":
            folder = engines.hf_folder("1b", engines.CACHE)
            model = tfm.load_any(str(folder), dtype=torch.bfloat16, quantize="int4", group_size=64)
        else:
            model = tfm.load_any(str(engines.gguf_file("1b", name, engines.CACHE)), dtype=torch.bfloat16)
        by_type = collections.defaultdict(list)
        for m in projections(model):
            by_type[type(m).__name__].append(m)
        for kind, mods in by_type.items():
            size = panel_bytes(mods)
            for r in rows:
                xs = [torch.randn(r, m.in_features, dtype=torch.bfloat16) for m in mods]
                with torch.no_grad():
                    for m, x in zip(mods, xs):
                        m(x)  # warm
                    bound = plain(3)
                    best = float("inf")
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        for m, x in zip(mods, xs):
                            m(x)
                        best = min(best, time.perf_counter() - t0)
                out[f"{name}/{kind}/R{r}"] = [size / best / 1e9, bound]
        del model
    return out


def child(src: Path, rows: list[int], reps: int, threads: int) -> dict[str, list[float]]:
    """``measure`` in a fresh process over the source tree ``src``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(Path(__file__).parents[1])])}
    return run_child("benchmarks.panel_rates", [rows, reps, threads], RESULT, env=env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="threads of the products and the plain read")
    p.add_argument("--against", type=Path, help="another source tree (its src/) to alternate with")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(measure(*json.loads(args.child))), flush=True)
        return 0
    rows = [int(r) for r in args.rows.split(",")]
    trees = {"this": Path(__file__).parents[1] / "src"}
    if args.against:
        trees["against"] = args.against.resolve()
    got: dict[str, dict[str, list[float]]] = {label: collections.defaultdict(list) for label in trees}
    share: dict[str, list[float]] = collections.defaultdict(list)  # this tree's GB/s / the plain read's
    for r in range(args.rounds):
        for label, src in trees.items() if r % 2 == 0 else reversed(trees.items()):
            for key, (value, bound) in child(src, rows, args.reps, args.threads).items():
                got[label][key].append(value)
                if label == "this":
                    share[key].append(value / bound)
    cell = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"  # noqa: E731
    head = "| model / panel type / rows | this tree, GB/s median (range) | of the plain read, median (range) |"
    print(head + (" against | this / against, median |" if args.against else ""))
    print("|---|---:|---:|" + ("---:|---:|" if args.against else ""))
    for key, values in got["this"].items():
        fraction = f"{statistics.median(share[key]):.0%} ({min(share[key]):.0%}-{max(share[key]):.0%})"
        line = f"| {key} | {cell(values)} | {fraction} |"
        if args.against:
            other = got["against"][key]
            line += f" {cell(other)} | {statistics.median(values) / statistics.median(other):.2f}x |"
        print(line)
    print(
        f"\n{args.rounds} rounds, each a fresh process per tree (alternating), {args.threads} thread(s), best of "
        f"{args.reps} passes each; "
        f"the plain read (benchmarks.decode.streaming_reader over {PLAIN_BYTES / 1e6:.0f} MB, best of 3) "
        "measured in the child just before each row's passes"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
