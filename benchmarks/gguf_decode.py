"""Decode tokens/s of torchformer on llama.cpp's GGUF files against its own format of the same
bits, in one process (issue 29): the engines benchmark runs each system in a process of its own
minutes apart, and this machine's memory bandwidth moves by a third over minutes, so its per-round
ratios between two torchformer rows spread by +-20%. Here the models (compiled, 2 threads) are
loaded side by side and their generates alternate, the order reversed every round: each ratio
pairs two calls seconds apart. Per model: median and best tokens/s after the first token (a
64-token prompt, 48 new, greedy), each file's per-round ratio to the own format, and the GB/s its
weights are read at (bytes a step x steps/s) as a fraction of the machine's plain read
(benchmarks.decode.streaming_reader over the largest model's bytes) measured in the same round:
where the own format already reads at the plain read, a file with more bytes a step cannot beat
the byte ratio.

    python -m benchmarks.gguf_decode --shape 1b --rounds 10
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks import engines
from benchmarks.decode import streaming_reader

OWN = {"4-bit": ("int4", ["Q4_0", "Q4_K_M"]), "8-bit": ("int8", ["Q8_0"])}


def runners(shape: str, bits: str, group_size: int) -> dict:
    """Our own format from the bf16 folder, then the files of the same bits, each a compiled engine."""
    scheme, files = OWN[bits]
    base = {"threads": 2, "group_size": group_size, "mode": "compiled"}
    specs = {f"{scheme} (own)": {**base, "folder": str(engines.hf_folder(shape, engines.CACHE)), "scheme": scheme}}
    for kind in files:
        specs[f"{kind} file"] = {**base, "folder": str(engines.gguf_file(shape, kind, engines.CACHE)), "scheme": None}
    return {label: engines.RUNNERS["torchformer"](spec) for label, spec in specs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b", choices=sorted(engines.SHAPES))
    p.add_argument("--bits", default="4-bit", choices=sorted(OWN))
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--group-size", type=int, default=64)
    args = p.parse_args(argv)
    models = runners(args.shape, args.bits, args.group_size)
    ids = engines.prompt_ids(1, 64, engines.SHAPES[args.shape]["vocab"])
    for engine in models.values():  # compile, fault the weights in
        engine.generate(ids, 48)
        engine.generate(ids, 48)
    size = {label: engines.torch_streamed_bytes(engine.model) for label, engine in models.items()}
    plain = streaming_reader(max(size.values()))
    tok_s: dict[str, list[float]] = {label: [] for label in models}
    reads: dict[str, list[float]] = {label: [] for label in models}  # fraction of the round's plain read
    for r in range(args.rounds):
        bound = plain(3)
        for label in list(models) if r % 2 == 0 else list(models)[::-1]:
            tok_s[label].append(models[label].generate(ids, 48)[1])
            reads[label].append(tok_s[label][-1] * size[label] / 1e9 / bound)
    own = next(iter(models))
    print(
        "| model | MB a step | decode tok/s, median | best | vs own, per-round median (range) | best / own's best "
        "| of the plain read, median (best) |"
    )
    print("|---|---:|---:|---:|---|---:|---:|")
    for label, values in tok_s.items():
        if label == own:
            vs, best = "-", "-"
        else:
            per = [a / b for a, b in zip(values, tok_s[own])]
            vs = f"{statistics.median(per):.3f}x ({min(per):.2f}-{max(per):.2f})"
            best = f"{max(values) / max(tok_s[own]):.3f}x"
        share = f"{statistics.median(reads[label]):.0%} ({max(reads[label]):.0%})"
        mb, median, top = size[label] / 1e6, statistics.median(values), max(values)
        print(f"| {label} | {mb:.0f} | {median:.1f} | {top:.1f} | {vs} | {best} | {share} |")
    print(f"\n{args.shape} shape, batch 1, 2 threads, compiled; {args.rounds} alternating rounds in one process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
