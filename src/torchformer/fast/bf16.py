"""bf16 weights on the CPU: ``Bf16Linear``, a bf16 ``Linear`` whose inference products run the
kernels of csrc/bf16.cpp over its own weight (no copy, no packing), and which product takes a call
by its rows and activation dtype (``dot_takes``, ``units_take``, ``kernels_take``), measured below."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..nn.linear import Linear, cpu_bf16_units
from .quant_panels import finished, rows_in, rows_of

# From this many rows (a prefill) the kernel, which re-reads its x rows per weight tile, loses to
# MKL's fp32 product over WIDEN_SLICE weight rows widened at a time (bounded scratch, never the
# whole matrix). Measured over 2 layers of the Llama-3.2-1B shape, 2 threads: 16 rows: kernel
# 45 GFLOP/s, slices 26; 64 rows: 42 vs 59; 512 rows: 40 vs 125.
WIDEN_ROWS, WIDEN_SLICE = 48, 256

# On a CPU with bf16 dot-product units (AVX512-BF16 or AMX) a bf16 model's activations are already
# bf16, and oneDNN's bf16 product (F.linear) multiplies them natively: from UNIT_ROWS rows it beats
# both the kernel over fp32 x and the widened slices. Measured (benchmarks.formats: 4 layers of the
# 1B shape, 2 threads, an AVX512-BF16 EPYC, ms, kernel or widened slices vs F.linear): 1 row 17.1 vs
# 30.7, 2: 18.7 vs 24.7, 4: 24.7 vs 33.4, 5: 37.2 vs 26.9, 8: 55.6-58.9 vs 30.9-32.9, 64: 214 vs 92,
# 256: 711 vs 296. Without those units torch converts at every call: never taken. Decided once.
BF16_UNITS = cpu_bf16_units()
# With AMX tiles oneDNN's product overtakes every other from AMX_ROWS rows: measured over 4 layers of
# the 1B shape (benchmarks.formats, 2 threads, the Intel Xeon of RESULTS.md, best of 5-7, ms, the
# vdpbf16ps kernel below / F.linear; 2026-12-07): 1 row 20.2 / 27.1, 2: 20.3 / 25.5, 3: 25.9 / 25.7,
# 4: 29.0 / 26.9, 8: 32.8 / 27.2, 12: 44.4 / 28.1. There both thresholds below are AMX_ROWS.
AMX = torch.cpu._is_amx_tile_supported()
AMX_ROWS = 4
UNIT_ROWS = AMX_ROWS if AMX else 5
# Where the CPU has AVX512-BF16 itself, bf16 activations of fewer than DOT_ROWS rows take the
# kernel's `vdpbf16ps` product instead (csrc/bf16.cpp ``bf16_dot``: x as it comes, one instruction
# per 64-byte weight line and row), ahead of both. Measured over the 1B shape's 113 matrices (2
# threads, the same EPYC, best of 4, ms, bf16_dot / bf16_linear over fp32 x / F.linear): 1 row
# 73.9 / 74.0 / 149, 2: 71.2 / 80.7 / 146, 4: 81.3 / 118 / 154, 8: 112 / 284 / 182, 12: 172 / 366
# / 203, 16: 224 / 505 / 223; one row against a plain streaming read of the same bytes: 34.0 GB/s
# against bf16_linear's 32.2 (the read 35.9). AMX without AVX512-BF16 (and so any AVX2 CPU): not taken.
DOT_UNITS = torch.cpu._is_avx512_bf16_supported()
DOT_ROWS = AMX_ROWS if AMX else 16


def widened_product(x2: Tensor, w: Tensor) -> Tensor:
    """x2 (rows, K) fp32 @ w (N, K)^T for a 16-bit w: each slice of rows of w widened to fp32
    then multiplied by MKL (rows, N)."""
    out_t = x2.new_empty((w.shape[0], x2.shape[0]))  # (N, rows): each slice's result is contiguous
    for start in range(0, w.shape[0], WIDEN_SLICE):
        part = w[start : start + WIDEN_SLICE].float()  # (slice, K)
        torch.mm(part, x2.t(), out=out_t[start : start + WIDEN_SLICE])
    return out_t.t()  # (rows, N)


def dot_takes(x: Tensor) -> bool:
    """Whether the kernel's vdpbf16ps product takes x: bf16 x below DOT_ROWS rows where the CPU has
    AVX512-BF16 (module top)."""
    return BF16_UNITS and DOT_UNITS and x.dtype == torch.bfloat16 and rows_in(x) < DOT_ROWS


def units_take(x: Tensor) -> bool:
    """Whether oneDNN's bf16 product (F.linear) takes x: bf16 x on bf16 units from UNIT_ROWS rows,
    where the vdpbf16ps product does not."""
    return BF16_UNITS and x.dtype == torch.bfloat16 and rows_in(x) >= UNIT_ROWS and not dot_takes(x)


def kernels_take(x: Tensor) -> bool:
    """Whether the kernels' own products take x (vdpbf16ps, or the kernel over fp32 x below
    WIDEN_ROWS rows), not oneDNN's nor the widened slices: each output a sum over its own weight
    row only, so a product over rows laid end to end gives each part bit for bit (fast/joint.py)."""
    return dot_takes(x) or (not units_take(x) and rows_in(x) < WIDEN_ROWS)


def bf16_product(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) @ w (N, K)^T for a contiguous bf16 w where oneDNN's product does not take x
    (``units_take``): (rows, N) fp32 by the vdpbf16ps kernel, the kernel over fp32 x or the
    widened slices."""
    if dot_takes(x):  # vdpbf16ps over x as it comes
        return torch.ops.torchformer.bf16_dot(x.reshape(rows_in(x), -1).contiguous(), w)
    x2 = rows_of(x)  # (rows, K) fp32
    return torch.ops.torchformer.bf16_linear(x2, w) if x2.shape[0] < WIDEN_ROWS else widened_product(x2, w)


class Bf16Linear(Linear):
    """A bf16 ``Linear`` whose inference products on the CPU run the kernel over its own weight
    (csrc/bf16.cpp ``bf16_linear``: no copy, no packing, the same Parameters and state dict).
    torch's bf16 products on a CPU without bf16 units convert at every call (measured 1 / 8 / 64
    rows over 4 layers of the Llama-3.2-1B shape: see benchmarks/RESULTS.md); on a CPU with bf16
    units, bf16 activations take the kernel's vdpbf16ps product below DOT_ROWS rows where the CPU
    has AVX512-BF16, and oneDNN's bf16 product from there (from UNIT_ROWS rows without it).
    Training, autograd, other dtypes and devices take ``Linear``'s path."""

    @classmethod
    def of(cls, source: Linear) -> Bf16Linear:
        twin = cls.__new__(cls)
        twin.__dict__.update(source.__dict__)  # the same Parameters, hooks and flags, not copies
        return twin

    def forward(self, x: Tensor) -> Tensor:
        if not self.runs(x):
            return super().forward(x)
        if units_take(x):
            return F.linear(x, self.weight, self.bias)  # oneDNN's bf16 product
        return self.finish(bf16_product(x, self.weight.contiguous()), x)

    def runs(self, x: Tensor) -> bool:
        """Whether this call takes the bf16 products above: inference on the CPU over a bf16 weight."""
        w = self.weight
        return w.dtype == torch.bfloat16 and x.is_cpu and w.is_cpu and not self.grad_needed(x)

    def finish(self, out: Tensor, x: Tensor) -> Tensor:
        return finished(out, x, self.bias, self.out_features)

    def grad_needed(self, x: Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
