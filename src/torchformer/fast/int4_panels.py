"""The int4 quantized linears in the CPU kernels' panels (fast/quant_panels.py for the layout, the
numerics and ``PanelLinear``): ``Int4Linear`` (symmetric, q + 8 a nibble) and ``Int4MinLinear``
(GGUF's Q4_K / Q4_1: w = s * u - m per group, the nibbles u as stored), products by
``torchformer::int4_mm`` / ``int4_min_mm`` (csrc/quantized.cpp)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.quant import Int4Linear, QuantLinear
from ..nn.quant_min import Int4MinLinear
from . import two_level
from .panels import LANES, panels, stream_zeros, streamed
from .quant_panels import PanelLinear, fp32, from_panels


class Int4Panels(PanelLinear, Int4Linear):
    """``Int4Linear`` as panels (P, K / 8, 16, 4) of bytes (each 64-byte line: 8 inputs of 16
    outputs; byte i of an output's 4 holds input i (low nibble) and i + 4 (high), each q + 8) and
    its scales as (P, K / G, 16)."""

    dequant_bits = 4

    def allocate(self, group_size: int | None) -> None:
        P, K, self.group_size = -(-self.out_features // LANES), self.in_features, group_size
        self.register_buffer("panels", stream_zeros((P, K // 8, LANES, 4), torch.uint8), persistent=False)
        self.register_buffer("scale", stream_zeros((P, K // group_size, LANES), torch.float32), persistent=False)

    def write(self, rows: slice, q: Tensor, scale: Tensor) -> None:
        p = rows.start // LANES
        u = (q + 8).to(torch.uint8).view(q.shape[0], -1, 2, 4)  # (n, K/8, 2, 4) in [1, 15]
        block = panels(u[:, :, 0] | (u[:, :, 1] << 4))  # (p', K/8, 16, 4)
        self.panels[p : p + block.shape[0]] = block
        self.scale[p : p + block.shape[0]] = panels(scale)  # (p', K/G, 16)

    def product(self, x2: Tensor) -> Tensor:
        n, g = self.out_features, self.group_size
        return torch.ops.torchformer.int4_mm(x2, self.panels, self.scale, n, g, *self.super_args())

    def portable(self) -> Int4Linear:
        N = self.out_features
        b = from_panels(self.in_order("panels"), N)  # (N, K/8, 4)
        q = torch.stack([(b & 0xF).to(torch.int16) - 8, (b >> 4).to(torch.int16) - 8], dim=2).reshape(N, -1)
        return Int4Linear.from_values(q, from_panels(self.full_scales(), N).contiguous(), self.bias, self.group_size)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


class Int4MinPanels(Int4Panels, Int4MinLinear):
    """``Int4MinLinear`` as Int4Panels' panels (the nibbles u, the kernel taking them without an
    offset) and scales, plus its minimums as (P, K / G, 16): ``int4_min_mm`` subtracts each group's
    minimum times the group's sum of x (nn/quant_min.py)."""

    half_scales = False  # int4_min_mm takes fp32 or two-level scales only
    dequant_bits = 0  # its minimums: the integer kernels only
    portable_names = ("qweight", "scale", "minimum")
    LAID = ("panels", "scale", "minimum")

    def allocate(self, group_size: int | None) -> None:
        super().allocate(group_size)
        self.register_buffer("minimum", stream_zeros(tuple(self.scale.shape), self.scale.dtype), persistent=False)
        self.register_buffer("super_min", None, persistent=False)  # (P, K/SG, 16) f16: two-level only

    def fill(self, source: QuantLinear) -> None:
        self.minimum, self.super_min = fp32(self.minimum), None  # written in fp32 (compact_scales)
        super().fill(source)

    def two_level_ok(self, source: QuantLinear) -> bool:
        """The kernel takes two-level scales with two-level minimums of the same super-block: both
        or neither (then the minimums are fp32, as the scales)."""
        parts = getattr(source, "minimum_parts", None)
        found = two_level.fits(parts, self.minimum, self.group_size)
        if found is None or parts.size != source.scale_parts.size:
            return False
        self.minimum, self.super_min = (streamed(t) for t in found)
        return True

    def full_minimums(self) -> Tensor:
        """The minimums (P, K/G, 16) fp32."""
        if self.super_min is None:
            return self.in_order("minimum")
        return two_level.expanded(self.minimum, self.super_min)

    def write(self, rows: slice, q: Tensor, scale: Tensor, minimum: Tensor) -> None:  # type: ignore[override]
        super().write(rows, q, scale)
        p, block = rows.start // LANES, panels(minimum)  # (p', K/G, 16)
        self.minimum[p : p + block.shape[0]] = block

    def product(self, x2: Tensor) -> Tensor:
        m, n, g = self.minimum, self.out_features, self.group_size
        sup, size, ways = self.super_args()
        return torch.ops.torchformer.int4_min_mm(x2, self.panels, self.scale, m, n, g, sup, self.super_min, size, ways)

    def portable(self) -> Int4MinLinear:
        plain = super().portable()  # Int4Linear over the same nibbles and scales
        minimum = from_panels(self.full_minimums(), self.out_features).contiguous()  # (N, K/G)
        return Int4MinLinear(plain.qweight, plain.scale, minimum, self.bias, self.group_size)
