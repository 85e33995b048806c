"""How long the first compiled ``generate`` takes (issue 25: the Llama-3.2-1B shape, <= 60 s).

Each measurement is a fresh process with one torch thread. "cold": its own empty inductor cache
and step cache (TORCHINDUCTOR_CACHE_DIR and TORCHFORMER_STEP_CACHE in a new temporary folder), as
on a user's first run; "warm": a second process on that same folder (a step compiled ahead,
fast/exported.py, is loaded from the step cache; dynamo's step, TORCHFORMER_AOT_STEP=0, hits the
FX graph and AOT autograd caches on disk and dynamo still traces).
The timed call is the first ``tfm.generate(model, prompt, max_new_tokens, compile=True)`` after
loading (prefill is eager, the decode step compiled; TORCHFORMER_NATIVE_STEP=0, since the native
batch-1 step of fast/native_step.py compiles nothing); loading is not timed. Reported: wall
seconds, CPU seconds of the process plus its children (inductor's compile workers and the C++
compiler), the graphs dynamo compiled, the region bodies it traced, and dynamo's own phase times.

    python -m benchmarks.compile_time --folder benchmarks/.cache/1b/hf --formats bf16 int8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

from benchmarks.child import run_child

RESULT = "COMPILE_TIME_RESULT "
FORMATS = ("bf16", "int8", "int4")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def child(folder: str, fmt: str, prompt: int, new_tokens: int) -> dict:
    """One measurement in this (fresh) process: load, then time the first compiled generate."""
    import torch
    from torch._dynamo.utils import counters
    from torch._dynamo.variables.invoke_subgraph import InvokeSubgraphHigherOrderVariable

    import torchformer as tfm
    from torchformer.fast import exported

    torch.set_num_threads(1)
    traced, trace = [], InvokeSubgraphHigherOrderVariable.create_wrapped_node

    def counting(self, *args, **kwargs):  # a region body dynamo traced (a reused one is not)
        traced.append(1)
        return trace(self, *args, **kwargs)

    InvokeSubgraphHigherOrderVariable.create_wrapped_node = counting
    quantize = None if fmt == "bf16" else fmt
    model = tfm.load_any(folder, dtype=torch.bfloat16, quantize=quantize, group_size=64 if fmt == "int4" else None)
    ids = torch.randint(1, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    wall, cpu = time.perf_counter(), cpu_seconds()
    first = tfm.generate(model, ids, max_new_tokens=new_tokens, compile=True)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    again = time.perf_counter()
    second = tfm.generate(model, ids, max_new_tokens=new_tokens, compile=True)
    again = time.perf_counter() - again
    assert torch.equal(first, second)
    phases = {k: round(v, 1) for k, v in torch._dynamo.utils.calculate_time_spent().items()}
    return {
        "step": "ahead" if exported.BUILT[0] else "dynamo",
        "steps_compiled": exported.COMPILED[0],
        "steps_loaded": exported.BUILT[0] - exported.COMPILED[0],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "format": fmt,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "graphs": counters["stats"]["unique_graphs"],
        "region_traces": len(traced),
        "second_call_s": round(again, 2),
        "phases": phases,
        "compile_threads": torch._inductor.config.compile_threads,
    }


def measured(args: argparse.Namespace, fmt: str, cache: str) -> dict:
    """``child`` for one format in a fresh process over the inductor cache ``cache``."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    env["TORCHFORMER_STEP_CACHE"] = os.path.join(cache, "steps")
    # the compiled graph's step: a batch-1 generate of a Llama-shaped model otherwise runs the
    # native step (fast/native_step.py), which compiles nothing
    env["TORCHFORMER_NATIVE_STEP"] = "0"
    if args.compile_threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.compile_threads)
    spec = [args.folder, fmt, args.prompt, args.new_tokens]
    return run_child("benchmarks.compile_time", spec, RESULT, env=env, timeout=args.timeout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="benchmarks/.cache/1b/hf", help="HF folder (default: the 1B shape)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=["bf16"])
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--compile-threads", type=int, default=None, help="inductor's (default: its own)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per measuring process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(child(*json.loads(args.child))), flush=True)
        return
    if not os.path.isdir(args.folder):
        parser.error(f"--folder {args.folder!r}: not a folder (benchmarks/engines.py writes the 1B shape's)")
    rows = []
    for fmt in args.formats:
        with tempfile.TemporaryDirectory(prefix="tfm-inductor-") as cache:
            cold = measured(args, fmt, cache)
            warm = measured(args, fmt, cache)
        rows.append((cold, warm))
        print(json.dumps({"cold": cold, "warm": warm}), file=sys.stderr, flush=True)
    print("| format | step | cold wall s | cold CPU s | graphs | region traces | cold peak RSS MiB "
          "| warm wall s | warm CPU s | warm step | warm peak RSS MiB |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for cold, warm in rows:
        again = "loaded" if warm["steps_loaded"] else "compiled" if warm["steps_compiled"] else "dynamo"
        print(f"| {cold['format']} | {cold['step']} | {cold['wall_s']} | {cold['cpu_s']} | {cold['graphs']} "
              f"| {cold['region_traces']} | {cold['peak_rss_mib']} | {warm['wall_s']} | {warm['cpu_s']} | {again} "
              f"| {warm['peak_rss_mib']} |")  # fmt: skip


if __name__ == "__main__":
    main()
