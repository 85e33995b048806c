"""RoPE scaling schemes: one small frozen class each, holding only the fields that scheme uses,
set as ``RoPE(scaling=...)``. The JSON ``kind`` words are transformers' ``rope_type`` names.
Imports no torch; nn/rope_scaling.py turns them into inverse frequencies at build time.

Static schemes (linear, llama3, yarn) fix the frequencies once; dynamic and longrope choose them
from the current length (the largest position + 1) on every forward. Keys already in a KV cache
keep the rotation they were written with, as in transformers, so for those two a cached decode
that crosses ``original_max_seq_len`` differs from a full recomputation at the final length.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rules import _check, _Validated


@dataclass(frozen=True, kw_only=True)
class LinearScaling(_Validated):
    """Position interpolation (Chen et al. 2023; kaiokendev): every frequency divided by factor."""

    _prefix = "positions.scaling."
    factor: float

    def _problems(self, p: list[str]) -> None:
        _above(p, self, "factor")

    def width_problems(self, dim: int, p: list[str]) -> None:
        """Append to ``p`` what this scheme needs of the rotated width ``dim`` (nothing here)."""
        return None


@dataclass(frozen=True, kw_only=True)
class DynamicNTK(_Validated):
    """Dynamic NTK-aware scaling (bloc97, emozilla): at length L > original_max_seq_len the base
    becomes base * (factor * L / original - (factor - 1)) ** (d / (d - 2)); at or below it, plain
    RoPE. transformers' ``max_position_embeddings`` is the original length; the model's
    ``max_seq_len`` is the longer context it may run at (from_hf sets factor * original)."""

    _prefix = "positions.scaling."
    factor: float
    original_max_seq_len: int

    def _problems(self, p: list[str]) -> None:
        _above(p, self, "factor", "original_max_seq_len")

    def width_problems(self, dim: int, p: list[str]) -> None:
        """Append to ``p`` a rotated width ``dim`` too small for the NTK base correction."""
        _check(p, dim > 2, "positions.scaling", "dynamic", f"needs more than 2 rotated features, got {dim}")


@dataclass(frozen=True, kw_only=True)
class Llama3Scaling(_Validated):
    """Llama 3.1's frequency-dependent interpolation: wavelengths longer than
    original / low_freq_factor are divided by factor, shorter than original / high_freq_factor
    kept, and those between blended linearly in original / wavelength."""

    _prefix = "positions.scaling."
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def _problems(self, p: list[str]) -> None:
        _above(p, self, "factor", "low_freq_factor", "original_max_seq_len")
        _check(
            p,
            self.high_freq_factor > self.low_freq_factor,
            "positions.scaling.high_freq_factor",
            self.high_freq_factor,
            f"must be > low_freq_factor={self.low_freq_factor}",
        )

    def width_problems(self, dim: int, p: list[str]) -> None:
        """Append to ``p`` what this scheme needs of the rotated width ``dim`` (nothing here)."""
        return None


@dataclass(frozen=True, kw_only=True)
class YaRN(_Validated):
    """YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow times over the original
    context are interpolated by factor, more than beta_fast times kept, a linear ramp between;
    cos and sin are multiplied by the attention factor (given, or 0.1 ln(factor) + 1, or the
    DeepSeek mscale ratio). factor None means max_seq_len / original_max_seq_len."""

    _prefix = "positions.scaling."
    factor: float | None
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def _problems(self, p: list[str]) -> None:
        _above(p, self, "factor", "original_max_seq_len", "beta_fast", "beta_slow", "attention_factor")

    def width_problems(self, dim: int, p: list[str]) -> None:
        """Append to ``p`` what this scheme needs of the rotated width ``dim`` (nothing here)."""
        return None

    def resolved_factor(self, max_seq_len: int) -> float:
        """The scaling factor: ``factor``, or when unset the model's context over the original one."""
        return max_seq_len / self.original_max_seq_len if self.factor is None else self.factor


@dataclass(frozen=True, kw_only=True)
class LongRoPE(_Validated):
    """LongRoPE (Ding et al. 2024; Phi-3): frequency i divided by short_factor[i] while the length
    is at most original_max_seq_len, by long_factor[i] beyond it; cos and sin are multiplied by the
    attention factor (given, or sqrt(1 + ln(factor) / ln(original)) for factor > 1, with factor
    None meaning max_seq_len / original_max_seq_len). One entry per rotated frequency."""

    _prefix = "positions.scaling."
    # tuple of floats; annotated bare so the shared scalar type check leaves it to _problems
    short_factor: tuple
    long_factor: tuple
    original_max_seq_len: int
    factor: float | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):  # JSON gives lists; keep configs hashable and equal
            value = getattr(self, name)
            if isinstance(value, list | tuple) and all(_number(x) for x in value):
                object.__setattr__(self, name, tuple(float(x) for x in value))
        super().__post_init__()

    def _problems(self, p: list[str]) -> None:
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            ok = isinstance(value, tuple) and all(_number(x) and x > 0 for x in value)
            _check(p, ok, f"positions.scaling.{name}", value, "must be a list of numbers > 0")
        _above(p, self, "original_max_seq_len", "factor", "attention_factor")

    def width_problems(self, dim: int, p: list[str]) -> None:
        """Append to ``p`` a factor list whose length is not the rotated width ``dim`` / 2."""
        for name in ("short_factor", "long_factor"):
            n = len(getattr(self, name))
            _check(
                p,
                n == dim // 2,
                f"positions.scaling.{name}",
                f"<{n} numbers>",
                f"needs {dim // 2} (rotated features / 2)",
            )

    def resolved_factor(self, max_seq_len: int) -> float:
        """The scaling factor: ``factor``, or when unset the model's context over the original one."""
        return max_seq_len / self.original_max_seq_len if self.factor is None else self.factor


def _above(p: list[str], obj: object, *names: str) -> None:
    """Each named field must be > 0; None (an optional field left unset) is skipped."""
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            _check(p, value > 0, f"positions.scaling.{name}", value, "must be > 0")


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


RoPEScaling = LinearScaling | DynamicNTK | Llama3Scaling | YaRN | LongRoPE
SCALING_KINDS: dict[str, type] = {
    "linear": LinearScaling,
    "dynamic": DynamicNTK,
    "llama3": Llama3Scaling,
    "yarn": YaRN,
    "longrope": LongRoPE,
}
SCALING_KIND_OF = {cls: kind for kind, cls in SCALING_KINDS.items()}
