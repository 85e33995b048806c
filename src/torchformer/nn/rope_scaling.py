"""Scaled RoPE: the inverse frequencies and attention factor of each scheme, and the two tables
whose frequencies follow the current length (dynamic NTK, LongRoPE).

The functions return (dim/2,) float64 on the CPU (build-time tables are computed there, then
placed; see positions.default_inv_freq). Each equals transformers' ``ROPE_INIT_FUNCTIONS`` entry
of the same name (tests/nn/test_rope_scaling.py checks it), written from the formulas.
The length-dependent tables take the current length as the largest position + 1, as HF does
(one rule per batch, chosen with tensor ops so a compiled step does not recompile), and compute
cos/sin in fp32 as HF does. Keys already in a KV cache keep the rotation they were written with.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .positions import default_inv_freq, placed


def linear_inv_freq(dim: int, base: float, factor: float) -> Tensor:
    """Position interpolation (Chen et al. 2023): positions / factor == frequencies / factor."""
    return default_inv_freq(dim, base) / factor


def llama3_inv_freq(dim: int, base: float, factor: float, low: float, high: float, original: int) -> Tensor:
    """Llama 3.1: long wavelengths (> original / low) interpolated by factor, short ones
    (< original / high) kept, the band between blended linearly in original / wavelength."""
    inv = default_inv_freq(dim, base)
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)  # 0 at the long edge of the band, 1 at the short
    blended = (1 - smooth) * inv / factor + smooth * inv
    kept_or_blended = torch.where(wavelen < original / high, inv, blended)
    return torch.where(wavelen > original / low, inv / factor, kept_or_blended)


def yarn_inv_freq(
    dim: int, base: float, factor: float, original: int, beta_fast: float, beta_slow: float, truncate: bool
) -> Tensor:
    """YaRN (Peng et al. 2023, "NTK-by-parts"): frequency i is interpolated by factor when it turns
    fewer than beta_slow times over the original context, kept when more than beta_fast times,
    with a linear ramp over the dimension indices between."""

    def index_for(rotations: float) -> float:  # the i with original / wavelength_i == rotations
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = index_for(beta_fast), index_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # a one-index ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )  # 1 = interpolate
    inv = default_inv_freq(dim, base)
    return inv / factor * ramp + inv * (1 - ramp)


def yarn_attention_factor(
    factor: float, attention_factor: float | None, mscale: float | None, mscale_all_dim: float | None
) -> float:
    """YaRN's cos/sin multiplier: given, or 0.1 ln(factor) + 1 (the paper's sqrt(1/t)), or
    DeepSeek-V2's ratio of that formula at mscale and at mscale_all_dim."""
    if attention_factor is not None:
        return attention_factor

    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return m(factor, mscale) / m(factor, mscale_all_dim)
    return m(factor)


def longrope_inv_freq(dim: int, base: float, ext_factors: tuple[float, ...]) -> Tensor:
    """LongRoPE (Ding et al. 2024): frequency i divided by its own searched factor."""
    return default_inv_freq(dim, base) / torch.tensor(ext_factors, dtype=torch.float64, device="cpu")


def longrope_attention_factor(factor: float, original: int, attention_factor: float | None) -> float:
    """Given, or sqrt(1 + ln(factor) / ln(original)) for factor > 1 (Phi-3), else 1."""
    if attention_factor is not None:
        return attention_factor
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def dynamic_inv_freq(dim: int, base: float, factor: float, original: int, length: Tensor) -> Tensor:
    """Dynamic NTK (bloc97, emozilla): at length L > original the base grows to
    base * (factor * L / original - (factor - 1))^(dim / (dim - 2)); plain RoPE at or below.
    length: a 0-d tensor; fp32 like HF.  -> (dim/2,)"""
    L = length.clamp(min=original).float()
    scaled_base = base * (factor * L / original - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=length.device) / dim
    return scaled_base ** (-exponents)


def _cos_sin(pos: Tensor, inv_freq: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    angles = pos[..., None].float() * inv_freq  # (B, T, E/2)
    return (angles.cos() * factor).unsqueeze(1), (angles.sin() * factor).unsqueeze(1)  # (B, 1, T, E/2)


def one_rule_length(model: nn.Module) -> int | None:
    """The longest input a model's RoPE rotates by one rule whatever its length: the smallest
    ``relative_up_to`` (the original length) of its length-following tables (dynamic NTK,
    LongRoPE), None where it has none. Beyond it the rotation depends on the whole input's length."""
    return min((n for m in model.modules() if (n := getattr(m, "relative_up_to", None)) is not None), default=None)


class DynamicNTKTable(nn.Module):
    """cos/sin with the dynamic-NTK base for the current length (largest position + 1).

    Stateless: each forward follows its own length. HF's module instead keeps the largest length
    seen until a call below the original; the two agree within one generate call."""

    def __init__(self, dim: int, base: float, factor: float, original: int) -> None:
        super().__init__()
        self.dim, self.base, self.factor, self.original = dim, base, factor, original
        self.relative_up_to = original  # longer inputs change the base: not offsets only (verify)

    def forward(self, pos: Tensor) -> tuple[Tensor, Tensor]:  # (B, T) -> (B, 1, T, E/2) each
        inv_freq = dynamic_inv_freq(self.dim, self.base, self.factor, self.original, pos.max() + 1)
        return _cos_sin(pos, inv_freq, 1.0)


class LongRoPETable(nn.Module):
    """cos/sin with LongRoPE's short factors while the length (largest position + 1) is at most
    ``original``, long factors beyond it (HF: seq_len > original_max_position_embeddings),
    times the attention factor. The choice is a torch.where, not a Python branch."""

    def __init__(self, short_inv_freq: Tensor, long_inv_freq: Tensor, original: int, attention_factor: float) -> None:
        super().__init__()
        self.args = (short_inv_freq, long_inv_freq)
        self.original, self.attention_factor = original, attention_factor
        self.relative_up_to = original  # up to here one rule: offsets only (verify)
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | None = None) -> None:
        short, long = self.args
        self.register_buffer("short_inv_freq", placed(short.float(), device), persistent=False)
        self.register_buffer("long_inv_freq", placed(long.float(), device), persistent=False)

    def forward(self, pos: Tensor) -> tuple[Tensor, Tensor]:  # (B, T) -> (B, 1, T, E/2) each
        inv_freq = torch.where(pos.max() + 1 > self.original, self.long_inv_freq, self.short_inv_freq)
        return _cos_sin(pos, inv_freq, self.attention_factor)
