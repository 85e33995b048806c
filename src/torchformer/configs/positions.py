"""Position schemes: one small frozen class each, so no field is meaningless for the scheme in
use. Re-exported by configs/__init__.py; imports no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from .rope_scaling import SCALING_KIND_OF, SCALING_KINDS, RoPEScaling
from .rules import _check, _check_choice, _tagged, _Validated


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
    fraction < 1 rotates only the first int(fraction * E) features of each head and passes the
    rest through (partial rotary: GPT-NeoX 0.25, Phi-4-mini 0.75); frequencies use that width.
    scaling None is plain RoPE; otherwise one scheme from configs/rope_scaling.py (the words are
    transformers' rope_type names: linear, dynamic, llama3, yarn, longrope).
    """

    base: float = 10000.0
    pairing: Literal["half", "interleaved"] = "half"
    fraction: float = 1.0
    scaling: RoPEScaling | None = None

    def _problems(self, p: list[str]) -> None:
        _check_choice(p, "positions.pairing", self.pairing, Literal["half", "interleaved"])
        _check(p, self.base > 1, "positions.base", self.base, "must be > 1")
        _check(p, 0 < self.fraction <= 1, "positions.fraction", self.fraction, "must be in (0, 1]")
        kinds = list(SCALING_KINDS.values())
        if self.scaling is not None and type(self.scaling) not in kinds:
            p.append(f"positions.scaling={self.scaling!r}: must be None or one of {[k.__name__ for k in kinds]}")
        elif self.scaling is not None:
            self.scaling._problems(p)

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading features of each head rotate (HF: int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.fraction)

    def head_problems(self, head_dim: int, p: list[str]) -> None:
        """Rules that need the model's head_dim (checked by ModelConfig)."""
        if self.fraction == 1:
            _check(p, head_dim % 2 == 0, "attention.head_dim", head_dim, "RoPE needs an even head_dim")
        else:
            dim = self.rotary_dim(head_dim)
            _check(
                p,
                dim >= 2 and dim % 2 == 0,
                "positions.fraction",
                self.fraction,
                f"int(fraction * head_dim={head_dim}) = {dim} rotated features: must be even and >= 2",
            )
        if self.scaling is not None and type(self.scaling) in SCALING_KINDS.values():
            self.scaling.width_problems(self.rotary_dim(head_dim), p)


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


def position_dict(pos: Positions) -> dict:
    """The JSON form {"kind": word, **fields}; a RoPE scaling scheme is tagged the same way."""
    out = {"kind": _KIND_OF[type(pos)], **{f.name: getattr(pos, f.name) for f in dataclasses.fields(pos)}}
    scaling = out.get("scaling")
    if scaling is not None:
        fields = {f.name: getattr(scaling, f.name) for f in dataclasses.fields(scaling)}
        lists = {k: list(v) for k, v in fields.items() if isinstance(v, tuple)}  # JSON has no tuples
        out["scaling"] = {"kind": SCALING_KIND_OF[type(scaling)], **fields, **lists}
    return out


def read_position(pos: dict[str, Any]) -> Positions:
    """A position scheme from its JSON form (tagged with ``kind``; RoPE's scaling tagged the same way)."""
    pos = dict(pos)
    if isinstance(pos.get("scaling"), dict):  # RoPE's scaling scheme, tagged the same way
        pos["scaling"] = _tagged(SCALING_KINDS, pos["scaling"], "positions.scaling")
    return _tagged(POSITION_KINDS, pos, "positions")
