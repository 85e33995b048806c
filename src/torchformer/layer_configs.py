"""Layers that differ: each layer names its kind, each kind overrides a few model-level settings.

Gemma 2 alternates sliding and global layers, Gemma 3 has 5 local : 1 global with a RoPE base
per kind, SmolLM3 drops RoPE on every 4th layer (NoPE), Qwen2 may window only its upper layers.
``ModelConfig.layer_kinds`` is one kind name per layer (``layer_pattern`` repeats a short
pattern); ``ModelConfig.kinds`` defines each name. A field left at ``INHERIT`` takes the
model-level value (``attention.sliding_window``, ``positions``). Kinds are resolved once at build
time (``resolve_kinds``); the stack computes one attention context per kind per forward and hands
each block its kind's context. Room for later axes (issue 17: the MLP kind) is one more field
here. Imports no torch; re-exported by config.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from .config_rules import _check, _raise
from .position_configs import RoPE, position_dict

if TYPE_CHECKING:
    from .config import ModelConfig

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


class ResolvedKind(NamedTuple):
    """A kind with every field decided: what the builder turns into modules."""

    sliding_window: int | None
    rope: RoPE | None
    mlp: str = "dense"  # "dense" or "moe"


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


def kind_problems(cfg: ModelConfig, n_layers: int, p: list[str]) -> None:
    """Rules between layer_kinds, kinds and the rest of the model (checked by ModelConfig)."""
    names, kinds = cfg.layer_kinds, cfg.kinds
    if not isinstance(kinds, tuple) or not all(isinstance(k, LayerKind) for k in kinds):
        p.append(f"kinds={kinds!r}: must be a tuple of LayerKind (or a dict name -> LayerKind)")
        return
    defined = [k.name for k in kinds]
    _check(p, all(isinstance(n, str) and n for n in defined), "kinds", defined, "every kind needs a non-empty name")
    if len(set(defined)) != len(defined):
        p.append(f"kinds={defined}: kind names must be unique")
    if names is None:
        _check(p, not kinds, "kinds", defined, "needs layer_kinds naming each layer's kind")
        return
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        p.append(f"layer_kinds={names!r}: must be a tuple of kind names (see layer_pattern)")
        return
    _check(p, len(names) == n_layers, "layer_kinds", names, f"has {len(names)} names, needs one per layer ({n_layers})")
    unknown = sorted(set(names) - set(defined))
    _check(p, not unknown, "layer_kinds", names, f"names unknown kinds {unknown}; defined in kinds: {defined}")
    _check(p, cfg.arch != "encoder_decoder", "layer_kinds", names, "are for arch 'decoder' or 'encoder'")
    for k in kinds:
        _check(p, k.mlp != "moe" or cfg.moe is not None, f"kinds[{k.name!r}].mlp", k.mlp, "'moe' needs the model's moe")
        if k.sliding_window not in (None, INHERIT):
            _check(p, cfg.arch == "decoder", f"kinds[{k.name!r}].sliding_window", k.sliding_window,
                   "is for causal decoders only")  # fmt: skip
        if k.rope != INHERIT:
            ok = cfg.positions is None or isinstance(cfg.positions, RoPE)
            model = type(cfg.positions).__name__
            _check(p, ok, f"kinds[{k.name!r}].rope", k.rope, f"needs model positions RoPE or None, not {model}")
        if isinstance(k.rope, RoPE):
            hd = cfg._head_dim_or_none()
            k.rope._problems(p)
            if hd is not None:
                k.rope.head_problems(hd, p)


def resolve_kinds(cfg: ModelConfig, n_layers: int) -> tuple[tuple[ResolvedKind, ...], tuple[int, ...]]:
    """(the distinct kinds in order of first use, each of ``n_layers`` layers' index into them). A
    model without layer_kinds has one kind: the model-level window and positions. Layer 0's kind
    is kind 0."""
    rope = cfg.positions if isinstance(cfg.positions, RoPE) else None
    model = ResolvedKind(cfg.attention.sliding_window, rope, "dense" if cfg.moe is None else "moe")
    if cfg.layer_kinds is None:
        return (model,), (0,) * n_layers
    by_name = {k.name: k for k in cfg.kinds}
    order = list(dict.fromkeys(cfg.layer_kinds))
    resolved = tuple(
        ResolvedKind(
            model.sliding_window if by_name[n].sliding_window == INHERIT else by_name[n].sliding_window,
            model.rope if by_name[n].rope == INHERIT else by_name[n].rope,
            model.mlp if by_name[n].mlp == INHERIT else by_name[n].mlp,
        )
        for n in order
    )
    return resolved, tuple(order.index(n) for n in cfg.layer_kinds)


def kind_from_dict(data: dict[str, Any], tagged) -> LayerKind:
    """A LayerKind from its JSON form; ``tagged`` reads a tagged RoPE dict (config.py's reader)."""
    data = dict(data)
    known = {f.name for f in dataclasses.fields(LayerKind)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in kinds: {unknown}; allowed: {sorted(known)}")
    if isinstance(data.get("rope"), dict):
        data["rope"] = tagged(data["rope"])
    return LayerKind(**data)
