"""Layers that differ: each layer names its kind, each kind overrides a few model-level settings.

Gemma 2 alternates sliding and global layers, Gemma 3 has 5 local : 1 global with a RoPE base
per kind, SmolLM3 drops RoPE on every 4th layer (NoPE), Qwen2 may window only its upper layers.
``ModelConfig.layer_kinds`` is one kind name per layer (``layer_pattern`` repeats a short
pattern); ``ModelConfig.kinds`` defines each name. A field left at ``INHERIT`` takes the
model-level value (``attention.sliding_window``, ``positions``). Kinds are resolved once at build
time (models/kinds.py); the stack computes one attention context per kind per forward and hands
each block its kind's context. Room for later axes (issue 17: the MLP kind) is one more field
here. Imports no torch; re-exported by configs/__init__.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from .positions import RoPE, position_dict, read_position
from .rules import _check, _raise

INHERIT = "inherit"
Inherit = Literal["inherit"]


@dataclass(frozen=True, kw_only=True)
class LayerKind:
    """One kind of layer. sliding_window: an int W (each query sees the last W keys), None (full
    attention) or "inherit". rope: a RoPE (this kind's base/scaling), None (NoPE: no rotation,
    SmolLM3) or "inherit" (the model's positions). mlp: "dense" (the block's MLP), "moe" (the
    model's ``moe`` experts) or "inherit" (moe when the model has ``moe``): DeepSeek's dense-first
    layers (first_k_dense_replace), Qwen-MoE's decoder_sparse_step / mlp_only_layers."""

    name: str = ""  # set from the dict key when kinds are given as {name: LayerKind(...)}
    sliding_window: int | None | Inherit = INHERIT
    rope: RoPE | None | Inherit = INHERIT
    mlp: Literal["dense", "moe", "inherit"] = INHERIT

    def __post_init__(self) -> None:
        p: list[str] = []
        where = f"kinds[{self.name!r}]"
        w = self.sliding_window
        ok = w in (None, INHERIT) or (isinstance(w, int) and not isinstance(w, bool) and w >= 1)
        _check(p, ok, f"{where}.sliding_window", w, "must be an integer >= 1, None (full attention) or 'inherit'")
        r = self.rope
        if r is not None and r != INHERIT and not isinstance(r, RoPE):
            p.append(f"{where}.rope={r!r}: must be a RoPE, None (NoPE) or 'inherit'")
        _check(p, self.mlp in ("dense", "moe", INHERIT), f"{where}.mlp", self.mlp, "must be dense, moe or inherit")
        _raise("LayerKind", p)

    def to_dict(self) -> dict[str, Any]:
        """The kind as JSON-ready data (its RoPE tagged with ``kind``)."""
        rope = self.rope if not isinstance(self.rope, RoPE) else position_dict(self.rope)
        return {"name": self.name, "sliding_window": self.sliding_window, "rope": rope, "mlp": self.mlp}


def layer_pattern(pattern: tuple[str, ...] | list[str], n_layers: int) -> tuple[str, ...]:
    """``pattern`` repeated (and cut) to ``n_layers`` names: Gemma 3's 5 local : 1 global is
    ``layer_pattern(("local",) * 5 + ("global",), 26)``."""
    if not pattern or not all(isinstance(k, str) for k in pattern):
        raise ValueError(f"pattern={pattern!r}: must be a non-empty sequence of kind names")
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r}: must be an integer >= 1")
    return tuple(pattern[i % len(pattern)] for i in range(n_layers))


def kinds_tuple(kinds: Any) -> Any:
    """``kinds`` given as {name: LayerKind} -> a tuple of named kinds (hashable, ordered)."""
    if isinstance(kinds, dict):
        return tuple(dataclasses.replace(k, name=n) if isinstance(k, LayerKind) else k for n, k in kinds.items())
    return tuple(kinds) if isinstance(kinds, list) else kinds


def kind_from_dict(data: dict[str, Any]) -> LayerKind:
    """A LayerKind from its JSON form (its RoPE a tagged dict)."""
    data = dict(data)
    known = {f.name for f in dataclasses.fields(LayerKind)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in kinds: {unknown}; allowed: {sorted(known)}")
    if isinstance(data.get("rope"), dict):
        data["rope"] = read_position(data["rope"])
    return LayerKind(**data)
