"""5- and 6-bit panels: how the kernels' twin of an ``Int8Linear`` (fast/quant_panels.py) holds
values that fit 5 or 6 bits (GGUF's Q5_0: q in [-16, 15]; Q6_K: [-32, 31]) in that many bits a
weight instead of int8's 8.

Legend: N out features, K in features, G group size, KL inputs per unit (32 for 5 bits, 16 for 6).

A decode step reads every weight once, so a Q5_0 / Q6_K matrix held as int8 (8.5 / 8.56 bits a
weight with its scales) reads ~1.5x / 1.3x the bytes the file stores (5.5 / 6.56). The layouts
(csrc/quantized_kernels.inc, ``Low``): per panel of 16 outputs, units of KL inputs of u = q +
2^(bits - 1) as 4-input registers (register r holds inputs 4r..4r+3 of the unit, byte i of an
output's 4 input 4r + i). 5 bits: 4 of int4's nibble lines (line l: register 2l's 4 inputs in the
low nibbles, 2l + 1's in the high ones), then one line whose byte i of an output's 4 holds each
register's byte i's high bit, register r's at bit r. 6 bits: 3 lines, registers 0-2 in their low 6
bits, register 3's bits 2l, 2l + 1 in line l's top two. The kernel unpacks them in registers, then
takes int4's dot products (the offset 2^(bits - 1) comes off with the block's sum of x, as int4's 8
does): its integer sums are int8's exactly, so the products are bit-equal to the same values' int8
panels.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOW_INPUTS = {5: 32, 6: 16}  # KL: inputs per unit


def low_bits(q: Tensor, k: int, group: int) -> int:
    """The fewest bits (5, 6, else 8) holding every signed value of q (N, K) for which the kernel
    takes K and the group (both multiples of the unit's KL inputs)."""
    if q.numel() == 0:
        return 8
    lo, hi = int(q.min()), int(q.max())
    for bits, kl in LOW_INPUTS.items():
        if -(1 << (bits - 1)) <= lo and hi < (1 << (bits - 1)) and k % kl == 0 and group % kl == 0:
            return bits
    return 8


def low_lines(q: Tensor, bits: int) -> Tensor:
    """Signed values q (n, K) that fit ``bits`` -> (n, K / KL * lines, 4) uint8, the units' lines."""
    kl, n = LOW_INPUTS[bits], q.shape[0]
    u = (q.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8).reshape(n, -1, kl // 4, 4)  # (n, K/KL, regs, 4)
    if bits == 6:  # registers 0-2 whole, register 3's bits 2l, 2l + 1 in line l's top two
        top = torch.stack([(u[:, :, 3] >> (2 * line)) & 3 for line in range(3)], dim=2)  # (n, K/KL, 3, 4)
        return (u[:, :, :3] | (top << 6)).reshape(n, -1, 4)
    nibbles = (u[:, :, 0::2] & 0xF) | ((u[:, :, 1::2] & 0xF) << 4)  # (n, K/KL, regs/2, 4)
    shifts = torch.arange(kl // 4, dtype=torch.uint8).view(-1, 1) * (bits - 4)  # (regs, 1): register r's bit
    high = ((u >> 4) << shifts).sum(2, dtype=torch.uint8)  # (n, K/KL, 4): disjoint bits, so the sum is an or
    return torch.cat([nibbles, high[:, :, None]], dim=2).reshape(n, -1, 4)


def low_values(b: Tensor, bits: int) -> Tensor:
    """The inverse of ``low_lines``: (N, K / KL * lines, 4) uint8 -> q (N, K) int8."""
    kl, n = LOW_INPUTS[bits], b.shape[0]
    b = b.reshape(n, -1, kl // 8 + 1, 4)  # (N, K/KL, lines, 4)
    if bits == 6:
        r3 = sum(((b[:, :, line] >> 6) << (2 * line)) for line in range(3))  # (N, K/KL, 4)
        u = torch.cat([b & 0x3F, r3[:, :, None]], dim=2)  # (N, K/KL, regs, 4)
        return (u.to(torch.int16) - 32).to(torch.int8).reshape(n, -1)
    nib = torch.stack([b[:, :, :-1] & 0xF, b[:, :, :-1] >> 4], dim=3).reshape(n, -1, kl // 4, 4)  # (N, K/KL, regs, 4)
    shifts = torch.arange(kl // 4, dtype=torch.uint8).view(-1, 1) * (bits - 4)  # (regs, 1)
    high = (b[:, :, -1:] >> shifts) & ((1 << (bits - 4)) - 1)  # (N, K/KL, regs, 4)
    return ((nib | (high << 4)).to(torch.int16) - (1 << (bits - 1))).to(torch.int8).reshape(n, -1)
