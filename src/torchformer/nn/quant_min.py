"""int4 with a minimum per group (asymmetric): llama.cpp's Q4_K, w = s * u - m, u in [0, 15].

Legend: N out features, K in features, G group size, rows = the product of x's leading dims.

Int4Linear (nn/quant.py) is symmetric: w = s * q, q in [-8, 7], stored as the nibble q + 8. Here
the nibble u = q + 8 is the value itself and each group also has a minimum m >= 0 subtracted:
w = s * u - m. The bytes, their nibble order and the scales are Int4Linear's (the same buffers, so
the same packing code and panel layout); ``minimum`` (N, K / G) fp32 is the one buffer added. A
GGUF Q4_K matrix loads into it with its numbers kept (interop/gguf/weights.py): s = d * sc and
m = dmin * m_j per 32 inputs, both exact in fp32, and ``dequantized`` computes s * u - m as the
``gguf`` package does, so the two agree bit for bit. The CPU kernels' twin (fast/quant_panels.py)
multiplies the nibbles as they are and subtracts m times the group's sum of x.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .linear import rowwise_product
from .quant import Int4Linear, quantize_by_blocks

UINT4_MAX = 15


class Int4MinLinear(Int4Linear):
    """int4 nibbles u (N, K // 2) uint8 (Int4Linear's packing of q = u - 8), fp32 scales and
    minimums per group (N, K // G) each: w = scale * u - minimum."""

    def __init__(self, qweight: Tensor, scale: Tensor, minimum: Tensor, bias: Tensor | None, group_size: int) -> None:
        super().__init__(qweight, scale, bias, group_size)
        if minimum.shape != scale.shape:
            raise ValueError(f"minimum has shape {tuple(minimum.shape)}; it must be the scale's, {tuple(scale.shape)}")
        self.register_buffer("minimum", minimum)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, group_size: int, on_block=None) -> Int4MinLinear:
        w = lin.weight.detach()  # (N, K)
        N, K = w.shape
        packed = torch.empty(N, K // 2, dtype=torch.uint8, device=w.device)
        scale = torch.empty(N, K // group_size, dtype=torch.float32, device=w.device)  # (N, K/G)
        minimum = torch.empty_like(scale)

        def write(rows: slice, q_rows: Tensor, s_rows: Tensor, m_rows: Tensor) -> None:
            packed[rows], scale[rows], minimum[rows] = cls.pack(q_rows, group_size), s_rows, m_rows

        quantize_by_blocks(w, lambda rows: cls.quantize_rows(rows, group_size), write, on_block=on_block)
        return cls(packed, scale, minimum, lin.bias, group_size)

    @staticmethod
    def quantize_rows(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
        """w (n, K) -> q = u - 8 (n, K) int16, the scales and minimums (n, K/G) fp32: each group's
        range [lo, hi], widened to hold 0 (so an all-zero group stays zero), over u in [0, 15]:
        s = (hi - lo) / 15, m = -lo."""
        n, K = w.shape
        groups = w.to(torch.float32, copy=True).reshape(n, K // group_size, group_size)  # (n, K/G, G)
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)  # (n, K/G) each
        scale = torch.where(hi > lo, (hi - lo) / UINT4_MAX, torch.ones_like(hi))
        minimum = -lo
        u = groups.add_(minimum[..., None]).div_(scale[..., None]).round_().clamp_(0, UINT4_MAX)
        return (u.to(torch.int16) - 8).reshape(n, K), scale, minimum

    @classmethod
    def from_values(cls, q: Tensor, scale: Tensor, minimum: Tensor, bias: Tensor | None, group_size: int):
        """From q = u - 8 (N, K) in [-8, 7], the scales and the minimums (N, K / G)."""
        return cls(cls.pack(q, group_size), scale, minimum, bias, group_size)

    def values(self, rows: slice) -> tuple[Tensor, Tensor, Tensor]:
        """q = u - 8 (n, K) int16, the scales and the minimums (n, K/G) of rows ``rows``."""
        q, scale = super().values(rows)
        return q, scale, self.minimum[rows]

    def dequantized(self) -> Tensor:
        N, K, G = self.out_features, self.in_features, self.group_size
        u = (self.unpacked() + 8).reshape(N, K // G, G).float()  # (N, K/G, G)
        return (self.scale[..., None] * u - self.minimum[..., None]).reshape(N, K)  # (N, K)

    def rows_product(self, x2: Tensor) -> Tensor:
        """Compiled few-row product over the dequantized expression (QuantLinear's)."""
        return rowwise_product(x2, self.dequantized())
