"""Products in each weight format at a real size: torchformer's CPU kernels against torch's own.

Over the seven projections of 4 layers of the Llama-3.2-1B shape (d 2048, d_ff 8192, 8 KV heads
of 64: 243M weights), at 1, 8 and 64 rows (batch-1 and batch-8 decoding, a prefill chunk):
bf16 (``Bf16Linear``: the kernel below 48 rows, widened slices and MKL above) against
``F.linear`` on bf16; int8 panels against ``torch._weight_int8pack_mm`` (torch's int8 weight-only
kernel, which is vectorised only for bf16 activations) and against ``torch._int_mm`` over x
quantized to int8 per row (the product of torchao's ``Int8DynamicActivationInt8WeightConfig``, which
oneDNN runs on VNNI / AMX-INT8; the rounding of x and the rescale counted in); int4 panels (group
64) against ``torch._weight_int4pack_mm_for_cpu`` (what torchao's ``Int4CPULayout`` calls); fp32
``F.linear`` (MKL) as the yardstick. Systems are
interleaved round by round and the best round kept; GB/s counts the bytes each format stores
(int4: half a byte plus its fp32 scale per 64 weights).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.results import load_note, write_section
from torchformer.fast import formats
from torchformer.fast.bf16 import Bf16Linear
from torchformer.nn.linear import Linear
from torchformer.nn.quant import Int4Linear, Int8Linear

D, FF, KV, LAYERS, GROUP = 2048, 8192, 512, 4, 64
SHAPES = [(D, D), (KV, D), (KV, D), (D, D), (FF, D), (FF, D), (D, FF)]  # q k v o gate up down: (N, K)


def systems(rows: int) -> dict[str, tuple[object, float]]:
    """name -> (one pass over every matrix, bytes stored per weight)."""
    torch.manual_seed(0)
    lins = [nn.Linear(k, n, bias=False) for _ in range(LAYERS) for n, k in SHAPES]
    x = {k: torch.randn(rows, k) for k in (D, FF)}
    xb = {k: v.bfloat16() for k, v in x.items()}
    bf16 = [Bf16Linear.of(Linear(m.in_features, m.out_features, bias=False).bfloat16()) for m in lins]
    for twin, m in zip(bf16, lins, strict=True):
        twin.weight.data.copy_(m.weight.data)
    q8 = [Int8Linear.from_linear(m) for m in lins]
    q4 = [Int4Linear.from_linear(m, GROUP) for m in lins]
    p8, p4 = [formats.Int8Panels(q) for q in q8], [formats.Int4Panels(q) for q in q4]
    torch4 = [
        (
            torch._convert_weight_to_int4pack_for_cpu(q.unpacked().int() + 8, 1),
            torch.stack([q.scale.t(), torch.zeros_like(q.scale.t())], -1).contiguous().bfloat16(),
            q.in_features,
        )
        for q in q4
    ]
    int4_bytes = 0.5 + 4 / GROUP
    int8_t = [(q.qweight.t().contiguous(), q.scale.float()) for q in q8]  # (K, N) int8 for _int_mm, (N,) scales
    return {
        "fp32 F.linear (MKL)": (lambda: [F.linear(x[m.in_features], m.weight) for m in lins], 4),
        "bf16 F.linear": (lambda: [F.linear(xb[m.in_features], m.weight) for m in bf16], 2),
        "bf16 torchformer": (lambda: [m(xb[m.in_features]) for m in bf16], 2),
        "int8 torch int8pack (bf16 x)": (
            lambda: [torch._weight_int8pack_mm(xb[q.in_features], q.qweight, q.scale.bfloat16()) for q in q8],
            1,
        ),
        "int8 torch _int_mm (int8 x per row)": (
            lambda: [dynamic_int8(x[w.shape[0]], w, scale) for w, scale in int8_t],
            1,
        ),
        "int8 torchformer panels": (lambda: [m(x[m.in_features]) for m in p8], 1),
        "int4 torch int4pack (bf16 x)": (
            lambda: [torch._weight_int4pack_mm_for_cpu(xb[k], w, GROUP, sz) for w, sz, k in torch4],
            int4_bytes,
        ),
        "int4 torchformer panels": (lambda: [m(x[m.in_features]) for m in p4], int4_bytes),
    }


def dynamic_int8(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x (rows, K) fp32 @ W^T through ``torch._int_mm``: x rounded to int8 per row (absmax / 127),
    the int32 product rescaled by both scales -> (rows, N) fp32."""
    x_scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127  # (rows, 1)
    xq = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
    return torch._int_mm(xq, w_t).float() * x_scale * w_scale


def measure(rows: int, rounds: int) -> dict[str, tuple[float, float]]:
    """name -> (best seconds per pass, bytes per weight)."""
    found = systems(rows)
    best = dict.fromkeys(found, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds):
            for name, (run, _) in found.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    return {name: (best[name], found[name][1]) for name in found}


# Each of ours against torch's kernels, its ratios in the table's last column in this order.
PEERS = {"bf16 torchformer": ("bf16 F.linear",),
         "int8 torchformer panels": ("int8 torch int8pack (bf16 x)", "int8 torch _int_mm (int8 x per row)"),
         "int4 torchformer panels": ("int4 torch int4pack (bf16 x)",)}  # fmt: skip


def table(results: dict[int, dict[str, tuple[float, float]]]) -> str:
    weights = LAYERS * sum(n * k for n, k in SHAPES)
    rows = [
        "| rows | system | ms | GB/s of stored weights | GFLOP/s | vs torch's kernel |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r, found in results.items():
        for name, (sec, per) in found.items():
            peers = [found[n][0] for n in PEERS.get(name, ()) if n in found]
            ratio = " / ".join(f"{t / sec:.2f}x" for t in peers)
            rows.append(
                f"| {r} | {name} | {sec * 1e3:.1f} | {weights * per / sec / 1e9:.1f} | "
                f"{2 * r * weights / sec / 1e9:.1f} | {ratio} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.formats", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", dest="write", action="store_false", help="do not update RESULTS.md")
    args = p.parse_args([] if argv is None else argv)
    if not formats.ops_ready():
        print("the CPU kernels are not built here (no AVX-512 or no compiler): nothing to compare")
        return 0
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    text = table({r: measure(r, args.rounds) for r in args.rows})
    print(text)
    if args.write:
        command = ("python -m benchmarks.formats " + " ".join(argv or [])).strip()
        setting = f"best of {args.rounds} interleaved rounds; {load_note(load)}"
        write_section("formats", "Weight formats at the Llama-3.2-1B shape (issue 25)", command, setting, text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
