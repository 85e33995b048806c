"""Position schemes: one small frozen class each, so no field is meaningless for the scheme in
use. Re-exported by config.py; imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config_rules import _check, _check_choice, _Validated


@dataclass(frozen=True, kw_only=True)
class Sinusoidal(_Validated):
    """Fixed sin/cos added to the embeddings (Vaswani et al. 2017, section 3.5).

    layout "interleaved": sin at even, cos at odd features (the paper);
    layout "split": sin in the first half, cos in the second (Marian, tensor2tensor).
    """

    layout: Literal["interleaved", "split"] = "interleaved"
    base: float = 10000.0

    def _problems(self, p: list[str]) -> None:
        _check_choice(p, "positions.layout", self.layout, Literal["interleaved", "split"])
        _check(p, self.base > 1, "positions.base", self.base, "must be > 1")


@dataclass(frozen=True, kw_only=True)
class Learned(_Validated):
    """A learned table added to the embeddings; ``offset`` rows are skipped (BART uses 2)."""

    offset: int = 0

    def _problems(self, p: list[str]) -> None:
        _check(p, self.offset >= 0, "positions.offset", self.offset, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RoPE(_Validated):
    """Rotary embeddings (Su et al. 2021) applied to q and k.

    pairing "half": feature i pairs with i + E/2 (HF Llama); "interleaved": 2i with 2i+1 (Meta).
    """

    base: float = 10000.0
    pairing: Literal["half", "interleaved"] = "half"

    def _problems(self, p: list[str]) -> None:
        _check_choice(p, "positions.pairing", self.pairing, Literal["half", "interleaved"])
        _check(p, self.base > 1, "positions.base", self.base, "must be > 1")


@dataclass(frozen=True, kw_only=True)
class ALiBi(_Validated):
    """Linear biases on attention scores, one slope per head (Press et al. 2022)."""

    def _problems(self, p: list[str]) -> None:
        return None


@dataclass(frozen=True, kw_only=True)
class RelativeBias(_Validated):
    """T5-style learned per-head scalar bias over bucketed relative distance."""

    num_buckets: int = 32
    max_distance: int = 128

    def _problems(self, p: list[str]) -> None:
        _check(p, self.num_buckets >= 4, "positions.num_buckets", self.num_buckets, "must be >= 4")
        _check(
            p,
            self.max_distance > self.num_buckets // 2,
            "positions.max_distance",
            self.max_distance,
            f"must be > num_buckets // 2 = {self.num_buckets // 2}",
        )


Positions = Sinusoidal | Learned | RoPE | ALiBi | RelativeBias
POSITION_KINDS: dict[str, type] = {
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rope": RoPE,
    "alibi": ALiBi,
    "relative_bias": RelativeBias,
}
_KIND_OF = {cls: kind for kind, cls in POSITION_KINDS.items()}
