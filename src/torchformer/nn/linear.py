"""nn.Linear whose few-row products take the fastest route for where they run.

y = x W^T + b is one matrix product either way round; what differs is how fast the weight is
streamed when x has few rows (every decode step, rows = batch; short prefills).

Eager: MKL's sgemm streams the weight much faster as (N, K) @ (K, rows) than as
(rows, K) @ (K, N). Measured on this 2-core machine over the 43 weight matrices of the decode
benchmark's model (92 MB, fp32, best of 10 passes): 1 row equal, 2 rows 2.3x, 8 rows 1.6x,
32 rows 1.2x, 64 rows 1.5x faster, 128 rows equal, 256 rows 0.8x; hence 2..FEW_ROWS = 64 rows
take that path. One row (batch-1 decoding), with autograd off, goes through it as a pair: the row
and a copy of it, since sgemm on two columns outruns MKL's one-row sgemv ~2.5x (``one_row_cpu``).

Compiled (torch.compile, inductor): up to COMPILED_ROWS rows, the product is written as an
elementwise multiply and a sum over the input dimension (``rowwise_product``). Inductor turns
that into a vectorised reduction that streams fp32 weights at the machine's bandwidth, about twice
MKL's GEMV (benchmarks/decode.py measures that bound; the gpt-fast observation that decoding is
weight-bandwidth bound). The choice is made at trace
time (``torch.compiler.is_compiling()`` is a constant while dynamo traces), so eager numerics are
unchanged and a compiled graph holds exactly one formulation; fp32 sums differ from MKL's only by
reassociation.

Batched decoding on the CPU goes further: fast/panels.py swaps these modules, for the scope of a
generation, for twins that multiply 3+ rows over a packed copy of the weight (the panel kernel:
4.5 against MKL's 12.8 ms at 8 rows over the decode benchmark's 92 MB, 2 threads). This module
knows nothing of it.

Same parameters and state-dict keys as nn.Linear, so checkpoints and interop key maps do not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEW_ROWS = 64
# Measured over the decode benchmark's matrices (fp32, 2 threads): the fused loop streams 19-26 GB/s
# for 1-4 rows; from 5 rows on it falls below MKL's W @ x^T (register pressure), which takes over.
# (An isolated loop over the 43 matrices looked faster at 8 rows, 5.2 vs 7.2 ms, but in the compiled
# decode step at batch 8 up-to-12 fused rows gave 474-481 tok/s against 559 with this limit.)
COMPILED_ROWS = 4


def cpu_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): elsewhere torch's bf16
    products convert at every call (~1 GFLOP/s). Asked at call time (a test may patch torch.cpu)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def one_row_cpu(x: Tensor) -> bool:
    """Whether one row x takes the paired product: eager fp32 on the CPU, no autograd (training
    keeps F.linear and its backward exactly as before).

    Measured over the decode benchmark's 43 weight matrices (92 MB fp32, weights cycling, best of
    200 interleaved passes): MKL's sgemv (F.linear with one row) streams ~11 GB/s at 1 or 2 threads,
    while its sgemm on the row and a copy of it, W @ [x; x]^T, streams ~17 GB/s at 1 thread and
    26-29 GB/s at 2 (oneDNN's inner product: ~11 and ~20). Same product, fp32 sums in another
    order: reassociation only."""
    return x.is_cpu and x.dtype == torch.float32 and not torch.is_grad_enabled()


def rowwise_product(x2: Tensor, weight: Tensor) -> Tensor:
    """x2 (rows, K) against weight (N, K): one multiply + sum over K per row -> (rows, N).

    The per-row reductions share their loop ranges and their weight operand, so inductor fuses
    them into one loop nest that loads each weight vector once and accumulates every row beside
    it. (Measured: 2-4 rows stream ~19-26 GB/s, against ~8-13 GB/s for one reduction over an
    (N, rows, K) product, which re-reads the weight per row.) Shared with the quantized linears,
    whose ``weight`` is an expression inductor fuses into the same loop: the int8 / int4
    dequantisation never writes an fp32 weight to memory."""
    return torch.stack([(weight * row.to(weight.dtype)).sum(-1) for row in x2.unbind(0)], dim=0)  # (rows, N)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K) @ weight (N, K)^T + bias (N,) -> (..., N)."""
    rows = x.numel() // max(1, x.shape[-1])
    # Trace-time choice (module docstring); measured on CPU, where MKL's GEMV is the bottleneck. On
    # CUDA, cuBLAS already streams near the memory bandwidth, so the product stays F.linear there.
    if torch.compiler.is_compiling() and x.is_cpu and 1 <= rows <= COMPILED_ROWS:
        out = rowwise_product(x.reshape(rows, -1), weight)  # (rows, N)
    elif rows == 1 and one_row_cpu(x):
        row = x.reshape(1, -1)  # (1, K)
        pair = torch.cat([row, row])  # (2, K): the row twice (one_row_cpu)
        out = torch.mm(weight, pair.t())[:, 0].contiguous()  # (N, K) @ (K, 2) -> (N, 2) -> first column (N,)
    elif rows <= 1 or rows > FEW_ROWS:  # one row with autograd (or not fp32 CPU): F.linear, as before
        return F.linear(x, weight, bias)
    else:
        out = (weight @ x.reshape(rows, -1).t()).t().contiguous()  # (N, K) @ (K, rows) -> (rows, N)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])  # (..., N); a view when out is contiguous


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
