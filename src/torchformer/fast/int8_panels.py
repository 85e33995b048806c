"""The int8 quantized linear in the CPU kernels' panels (fast/quant_panels.py for the layout, the
numerics and ``PanelLinear``): ``Int8Linear`` as bytes q + 128, or 5 / 6 bits a weight where every
value fits (GGUF's Q5_0 / Q6_K, fast/low_bits.py), products by ``torchformer::int8_mm`` /
``intn_mm`` (csrc/quantized.cpp)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.quant import Int8Linear, QuantLinear, row_blocks
from . import low_bits as low
from .panels import LANES, panels, stream_zeros
from .quant_panels import PanelLinear, from_panels


class Int8Panels(PanelLinear, Int8Linear):
    """``Int8Linear`` as panels (P, K / 4, 16, 4) of bytes q + 128 (each 64-byte line: 4 inputs of
    16 outputs; unsigned for the integer dot product, csrc/quantized.cpp) and its scales as
    (P, K / G, 16), G = K for one scale per row. Where every value fits 5 or 6 bits (GGUF's Q5_0
    and Q6_K, interop/gguf/weights.py) the panels hold that many bits a weight instead
    (fast/low_bits.py)."""

    bits = 8  # 5 or 6 where the values fit (fill): csrc's Low panels

    def allocate(self, group_size: int | None) -> None:
        P, K, self.group_size = -(-self.out_features // LANES), self.in_features, group_size
        self.register_buffer("panels", stream_zeros((P, K // 4, LANES, 4), torch.uint8), persistent=False)
        self.register_buffer("scale", stream_zeros((P, K // (group_size or K), LANES), torch.float32), persistent=False)

    def fill(self, source: QuantLinear) -> None:
        K, G = self.in_features, self.group_size or self.in_features
        # block by block: a source that decodes its rows as asked (interop/gguf/weights.py FileRows)
        # never makes the whole matrix at once
        bits = max(low.low_bits(source.values(rows)[0], K, G) for rows in row_blocks(self.out_features, K, LANES))
        if bits != self.bits:  # (P, K / 4, 16, 4), or (P, K / KL * lines, 16, 4) (low_lines)
            self.bits, P, K = bits, self.panels.shape[0], self.in_features
            lines = K // 4 if bits == 8 else K // low.LOW_INPUTS[bits] * (low.LOW_INPUTS[bits] // 8 + 1)
            self.panels = stream_zeros((P, lines, LANES, 4), torch.uint8)
        super().fill(source)

    def write(self, rows: slice, q: Tensor, scale: Tensor) -> None:
        p = rows.start // LANES
        if self.bits == 8:
            u = q.view(torch.uint8) ^ 0x80  # (n, K): q + 128, the top bit of a two's complement byte flipped
            block = panels(u.reshape(q.shape[0], -1, 4))  # (p', K/4, 16, 4)
        else:
            block = panels(low.low_lines(q, self.bits))  # (p', K/KL * lines, 16, 4)
        self.panels[p : p + block.shape[0]] = block
        self.scale[p : p + block.shape[0]] = panels(scale.reshape(q.shape[0], -1))  # (p', K/G, 16)

    def product(self, x2: Tensor) -> Tensor:
        group, n = self.group_size or self.in_features, self.out_features
        if self.bits != 8:
            sup, size, _ = self.super_args()  # never interleaved
            return torch.ops.torchformer.intn_mm(x2, self.panels, self.scale, n, group, self.bits, sup, size)
        return torch.ops.torchformer.int8_mm(x2, self.panels, self.scale, n, group, *self.super_args())

    def interleaves(self) -> bool:
        return self.bits == 8 and super().interleaves()

    @property
    def dequant_bits(self) -> int:  # type: ignore[override]
        return 8 if self.bits == 8 else 0

    def portable(self) -> Int8Linear:
        N = self.out_features
        b = from_panels(self.in_order("panels"), N)  # (N, K/4, 4) or (N, K/KL * lines, 4)
        if self.bits == 8:
            q = (b.reshape(N, -1) ^ 0x80).view(torch.int8)  # (N, K): the bytes - 128
        else:
            q = low.low_values(b, self.bits)  # (N, K)
        scale = from_panels(self.full_scales(), N)  # (N, K/G)
        scale = scale[:, 0].clone() if self.group_size is None else scale.contiguous()
        return Int8Linear(q, scale, self.bias, self.group_size)
