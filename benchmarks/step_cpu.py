"""CPU time of one decode step at one thread: torchformer against llama.cpp, format for format
(issue 25), and torchformer on llama.cpp's very GGUF files against its own format (issue 29), on
the engines benchmark's models (benchmarks/engines.py builds and caches them).

Wall-clock tokens/s on a shared 2-core machine measure the neighbours as much as the engine; the
CPU time a single-threaded process spends per step moves far less with them (it still pays for a
shared L3 and memory bus, so absolute values run high when the machine is busy). Per step =
(CPU time of a 48-token greedy generate - that of a 16-token one) / 32, so the prompt's prefill
cancels out. Each (system, format) runs in a process of its own (a compiled step compiles there
once, the inductor cache shared), the systems interleaved per round, best of the rounds.
On a CPU with AMX llama.cpp loads each model without its extra buffer types (engines.NO_REPACK: its
AMX product segfaults on quantized files there), so it runs its plain CPU products (AVX-512 / VNNI)
over the file's bytes as they are.

    python -m benchmarks.step_cpu --shape toy --rounds 3
    python -m benchmarks.step_cpu --shape toy --formats int8,int4 --rounds 5 --no-llama   # issue 29's rows
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks import engines

RESULT = "STEP-CPU "
LONG, SHORT = 48, 16  # new tokens; per step = the difference over LONG - SHORT steps


def systems(
    shape: str, formats: list[str], llama: bool = True
) -> tuple[list[tuple[str, str, dict]], list[tuple[str, str]]]:
    """(label, runner, spec) per system and format, and the label pairs to compare (the first's
    time over the second's). Each quantized format also runs torchformer on llama.cpp's very
    files (issue 29: Q8_0, Q4_0 and Q4_K_M load into our int8 / int4 modules), compared with our
    own format and with llama.cpp on the same file. llama=False: torchformer's rows only (the
    files are still made by llama.cpp's converter and quantizer)."""
    cache, out, pairs = engines.CACHE, [], []
    folder = engines.hf_folder(shape, cache)
    for fmt in formats:
        scheme, kinds, _ = engines.FORMATS[fmt]
        spec = {"threads": 1, "folder": str(folder), "scheme": scheme, "group_size": 64, "mode": "compiled"}
        own = f"torchformer {fmt} compiled"
        out.append((own, "torchformer", spec))
        for i, kind in enumerate(kinds if scheme is not None else kinds[:1]):
            gguf = engines.gguf_file(shape, kind, cache)
            theirs = f"llama.cpp {kind}"
            if llama:
                out.append((theirs, "llama.cpp", {"gguf": str(gguf), "threads": 1, "batches": [1], "context": 256,
                                                  "prompts": [64]}))  # fmt: skip
                if i == 0:
                    pairs.append((own, theirs))
            if scheme is not None:  # the same GGUF file, read by torchformer
                mine = f"torchformer {kind}-file compiled"
                out.append((mine, "torchformer", {**spec, "folder": str(gguf), "scheme": None}))
                pairs += [(mine, own)] + ([(mine, theirs)] if llama else [])
    return out, pairs


def worker(runner: str, spec: dict, vocab: int, repeats: int) -> dict:
    """In the child: warm up, then the best per-step CPU ms over ``repeats`` pairs of generates."""
    engine = engines.RUNNERS[runner](spec)
    ids = engines.prompt_ids(1, 64, vocab)

    def cpu(n: int) -> float:
        c0 = time.process_time()
        engine.generate(ids, n)
        return time.process_time() - c0

    cpu(LONG)  # compiles (torchformer) and faults the weights in
    best = min((cpu(LONG) - cpu(SHORT)) / (LONG - SHORT) for _ in range(repeats))
    mb = panel_bytes(projections(engine.model)) / 1e6 if runner == "torchformer" else None
    return {"cpu_ms": 1000 * best, "panel_mb": mb}


PANEL_BUFFERS = ("panels", "scale", "super_scale", "minimum", "super_min")


def projections(model) -> list:
    """The model's projections in the kernels' panels (fast/quant_panels.py)."""
    from torchformer.fast.quant_panels import PanelLinear

    return [m for m in model.modules() if isinstance(m, PanelLinear)]


def panel_bytes(modules) -> int:
    """Bytes the projections' kernel panels hold (weights, scales, two-level super-scales,
    minimums): what a one-token step reads of them."""
    found = (getattr(m, name, None) for m in modules for name in PANEL_BUFFERS)
    return sum(t.numel() * t.element_size() for t in found if t is not None)


def run_child(runner: str, spec: dict, vocab: int, repeats: int) -> dict | None:
    args = [sys.executable, "-m", "benchmarks.step_cpu", "--child", json.dumps([runner, spec, vocab, repeats])]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    engines.log(f"{runner} failed: {proc.stderr[-2000:]}")
    return None


def table(rows: dict[str, list[float | None]], pairs: list[tuple[str, str]], rounds: int, mb: dict) -> str:
    """Per pair: each side's best over the rounds, the best-of-rounds ratio, the median and range
    of the per-round ratios (a round's two rows ran minutes apart at most), and the panel bytes."""
    lines = ["| first vs second | first (CPU ms / step) | second | first / second, best | per-round ratios "
             "(median) | panel MB a step |", "|---|---:|---:|---:|---|---:|"]  # fmt: skip
    cell = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for first, second in pairs:
        a = min((v for v in rows[first] if v), default=None)
        b = min((v for v in rows[second] if v), default=None)
        ratio = f"{a / b:.2f}x" if a and b else "-"
        per = sorted(x / y for x, y in zip(rows[first], rows[second]) if x and y)
        spread = f"{per[0]:.2f}-{per[-1]:.2f} ({statistics.median(per):.2f})" if per else "-"
        size = f"{cell(mb.get(first))} vs {cell(mb.get(second))}"
        lines.append(f"| {short(first)} vs {short(second)} | {cell(a)} | {cell(b)} | {ratio} | {spread} | {size} |")
    lines.append(f"\nbest of {rounds} interleaved round(s), each the best of 3 pairs of generates in one process")
    return "\n".join(lines)


def short(label: str) -> str:
    """A label without " compiled" (every torchformer row here is compiled)."""
    return label.removesuffix(" compiled")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="toy", choices=sorted(engines.SHAPES))
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-llama", action="store_true", help="torchformer's rows only (own format vs GGUF files)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        runner, spec, vocab, repeats = json.loads(args.child)
        print(RESULT + json.dumps(worker(runner, spec, vocab, repeats)), flush=True)
        return 0
    missing = engines.engines_available(["llama.cpp"])["llama.cpp"]
    if missing:
        print(f"skipped: {missing} ({engines.INSTALL_HINT})")
        return 0
    found, pairs = systems(args.shape, args.formats.split(","), llama=not args.no_llama)
    rows: dict[str, list[float | None]] = {label: [] for label, _, _ in found}
    mb: dict[str, float] = {}
    vocab = engines.SHAPES[args.shape]["vocab"]
    for r in range(args.rounds):
        for label, runner, spec in found:
            got = run_child(runner, spec, vocab, 3) or {}
            ms = got.get("cpu_ms")
            engines.log(f"round {r + 1}: {label}: {ms} CPU ms a step")
            rows[label].append(ms)  # None for a failed run: the rounds stay aligned for the ratios
            if got.get("panel_mb") is not None:
                mb[label] = got["panel_mb"]
    print(table(rows, pairs, args.rounds, mb))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
