"""nn.Linear whose few-row products take the fastest route for where they run.

y = x W^T + b is one matrix product either way round; what differs is how fast the weight is
streamed when x has few rows (every decode step, rows = batch; short prefills).

Eager: MKL's sgemm streams the weight much faster as (N, K) @ (K, rows) than as
(rows, K) @ (K, N). Measured on this 2-core machine over the 43 weight matrices of the decode
benchmark's model (92 MB, fp32, best of 10 passes): 1 row equal, 2 rows 2.3x, 8 rows 1.6x,
32 rows 1.2x, 64 rows 1.5x faster, 128 rows equal, 256 rows 0.8x; hence 2..FEW_ROWS = 64 rows
take that path.

Compiled (torch.compile, inductor): up to COMPILED_ROWS rows, the product is written as an
elementwise multiply and a sum over the input dimension (``rowwise_product``). Inductor turns
that into a vectorised reduction that streams fp32 weights at ~31 GB/s here, twice MKL's GEMV (FACTS.md;
the gpt-fast observation that decoding is weight-bandwidth bound). The choice is made at trace
time (``torch.compiler.is_compiling()`` is a constant while dynamo traces), so eager numerics are
unchanged and a compiled graph holds exactly one formulation; fp32 sums differ from MKL's only by
reassociation.

Same parameters and state-dict keys as nn.Linear, so checkpoints and interop key maps do not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FEW_ROWS = 64
# Measured over the decode benchmark's 43 matrices (92 MB fp32, 2 threads, compiled, best of 8
# interleaved rounds; /tmp/exp_rows3.py of 2026-12-01): the fused loop against MKL's W @ x^T takes
# 3.8 vs 5.7 ms at 5 rows, 5.2 vs 7.2 at 8, 9.2 vs 13.1 at 12, 10.9 vs 10.5 at 16 rows (splitting
# the rows into loops of 3 or 4 was no faster); MKL takes over above 12 rows.
COMPILED_ROWS = 12


def _one_row_cpu():
    """oneDNN's inner product (the op inductor's CPU mkldnn fusions call), or None without oneDNN.

    One row in eager (batch-1 decoding, no autograd): MKL's sgemv runs single-threaded at these
    sizes (measured: 2 threads == 1 thread, 10-15 GB/s over the decode benchmark's matrices), while
    oneDNN splits the output rows over the threads (14-25 GB/s at 2 threads; 512x512 to 8192x512).
    Same product, fp32 accumulation in another order: differences are reassociation only."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


ONE_ROW_CPU = _one_row_cpu()


PLAIN = (Tensor, nn.Parameter)  # subclasses (DTensor, fake and functional tensors) keep F.linear's dispatch


def one_row_cpu(x: Tensor, weight: Tensor) -> bool:
    """Whether ONE_ROW_CPU takes x (one row): eager fp32 on the CPU, plain tensors, no autograd
    (the op has no backward)."""
    return (
        ONE_ROW_CPU is not None
        and x.is_cpu
        and weight.is_cpu
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and type(x) in PLAIN
        and type(weight) in PLAIN
    )


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
    elif rows == 1 and one_row_cpu(x, weight):
        return ONE_ROW_CPU(x, weight, bias, "none", [], "")  # (..., N)
    elif rows <= 1 or rows > FEW_ROWS:  # one row: both ways stream equally, F.linear has less overhead
        return F.linear(x, weight, bias)
    else:
        out = (weight @ x.reshape(rows, -1).t()).t().contiguous()  # (N, K) @ (K, rows) -> (rows, N)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])  # (..., N); a view when out is contiguous


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
