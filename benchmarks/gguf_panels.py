"""The toy step's 43 projections at one row, in one process (issue 29): our int4 g64 against the
Q4_K_M file with its Q5_0 / Q6_K tensors in int8 panels (as before the 5- and 6-bit panels) and in
5- / 6-bit panels (fast/low_bits.py). Thread CPU time of all the projections' products per pass,
the three models interleaved per round, best and median of the rounds: a busy machine moves this
less than a whole decode step (benchmarks/step_cpu.py), and it leaves out the step's fixed cost.

    python -m benchmarks.gguf_panels --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import engines
from benchmarks.step_cpu import panel_bytes, projections


def models() -> dict:
    """int4 g64 of the toy folder; the Q4_K_M file with int8 panels (low_bits forced to 8) and as loaded."""
    import torchformer as tfm
    from torchformer.fast import low_bits

    folder, gguf = engines.hf_folder("toy", engines.CACHE), engines.gguf_file("toy", "Q4_K_M", engines.CACHE)
    out = {"int4 g64": tfm.load_any(str(folder), dtype=torch.bfloat16, quantize="int4", group_size=64)}
    chosen = low_bits.low_bits
    low_bits.low_bits = lambda *_: 8
    try:
        out["Q4_K_M file, int8 panels"] = tfm.load_any(str(gguf), dtype=torch.bfloat16)
    finally:
        low_bits.low_bits = chosen
    out["Q4_K_M file, 5-/6-bit panels"] = tfm.load_any(str(gguf), dtype=torch.bfloat16)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--passes", type=int, default=40)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    mods = {key: projections(model) for key, model in models().items()}
    xs = {key: [torch.randn(1, m.in_features) for m in ms] for key, ms in mods.items()}
    times: dict[str, list[float]] = {key: [] for key in mods}
    with torch.no_grad():
        for _ in range(args.rounds):
            for key, ms in mods.items():
                for m, x in zip(ms, xs[key]):
                    m.product(x)  # warm: the panels into cache as a step finds them
                t0 = time.thread_time()
                for _ in range(args.passes):
                    for m, x in zip(ms, xs[key]):
                        m.product(x)
                times[key].append((time.thread_time() - t0) / args.passes * 1e3)
    base = "int4 g64"
    print("| model | projections | best (ms) | median (ms) | vs int4 g64, best | per-round ratios (median) |")
    print("|---|---:|---:|---:|---:|---|")
    for key, ms in mods.items():
        per = sorted(a / b for a, b in zip(times[key], times[base]))
        ratio = "-" if key == base else f"{min(times[key]) / min(times[base]):.2f}x"
        spread = "-" if key == base else f"{per[0]:.2f}-{per[-1]:.2f} ({statistics.median(per):.2f})"
        mb, best, median = panel_bytes(ms) / 1e6, min(times[key]), statistics.median(times[key])
        print(f"| {key} | {mb:.2f} MB | {best:.3f} | {median:.3f} | {ratio} | {spread} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
