"""Two-level group scales, GGUF's K-quant form, kept in the kernels' panels (fast/quant_panels.py).

Legend: N out features, K in features, G inputs per group (its scale), SG inputs per super-block
(256 in every K-quant), P = ceil(N / 16) panels.

A K-quant file stores each group's scale as a small integer times an f16 scale per super-block:
Q6_K an int8 sc per 16 inputs under an f16 d per 256 (scale d * sc), Q4_K a 6-bit sc and m per 32
under f16 d and dmin (scale d * sc, minimum dmin * m). The portable modules hold the products in
fp32 (exact: 11 + 8 significant bits), 4 bytes a group; the panels can hold the two parts instead,
1 byte a group plus 2 per super-block: Q6_K reads 8.56 bits a weight instead of 10, Q4_K 4.63
instead of 6. The kernel (csrc/quantized.cpp, ``TwoLevel``; quantized_kernels.inc ``panel_super``)
runs them as llama.cpp runs its K-quant files: x rounded per super-block, each group's integer sums
times its int8 sub-scale in int32, one fp32 multiply by the super-scales per super-block (so its
products differ from the fp32-scales panels', which round x per group, by that rounding). The loader
(interop/gguf/weights.py) hands the parts over as ``scale_parts`` / ``minimum_parts`` attributes of
the portable module (not state: a checkpoint holds the fp32 scales); a panel twin takes them only
where they give back its fp32 scales bit for bit (``fits``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .panels import panels


@dataclass(frozen=True)
class TwoLevel:
    """A matrix's group scales (or minimums) as ``sub * super``: sub (N, K/G) int8, super (N, K/SG)
    f16, SG = ``size`` inputs per super-scale."""

    sub: Tensor  # (N, K/G) int8
    super: Tensor  # (N, K/SG) f16
    size: int

    def __post_init__(self) -> None:
        if self.sub.dtype != torch.int8 or self.super.dtype != torch.float16:
            raise ValueError(f"TwoLevel: sub must be int8 and super f16, got {self.sub.dtype} and {self.super.dtype}")
        n, groups = self.sub.shape
        if self.super.shape[0] != n or groups % self.super.shape[1]:
            raise ValueError(f"TwoLevel: sub {tuple(self.sub.shape)} and super {tuple(self.super.shape)} do not nest")

    def panels(self) -> tuple[Tensor, Tensor]:
        """(sub (P, K/G, 16) int8, super (P, K/SG, 16) f16): the kernel's layout."""
        return panels(self.sub), panels(self.super)


def expanded(sub: Tensor, sup: Tensor) -> Tensor:
    """sub (..., K/G, 16) int8 times sup (..., K/SG, 16) f16, each super-scale over its groups ->
    (..., K/G, 16) fp32 (exact: the product of an f16 and an int8 fits fp32's 24 bits)."""
    per = sub.shape[-2] // sup.shape[-2]  # groups per super-block
    return sup.float().repeat_interleave(per, dim=-2) * sub.float()


def fits(parts: TwoLevel | None, scale: Tensor, group: int) -> tuple[Tensor, Tensor] | None:
    """parts' panels (``TwoLevel.panels``) where they give back ``scale`` (P, K/G, 16) fp32 bit for
    bit and their super-block is whole groups; else None (the fp32 scales stay)."""
    if parts is None or parts.size % group or parts.sub.shape[1] != scale.shape[1]:
        return None
    sub, sup = parts.panels()
    if sub.shape != scale.shape:
        return None
    # compared a slab of panels at a time: the whole expansion is three fp32 copies of the scales
    # (a 1B shape's Q6_K head: ~190 MiB at its load's peak)
    step = max(1, (1 << 20) // max(1, sub[0].numel()))
    same = all(
        torch.equal(expanded(sub[p : p + step], sup[p : p + step]), scale[p : p + step])
        for p in range(0, sub.shape[0], step)
    )
    return (sub, sup) if same else None
