"""Per-layer settings of a config.json (``layer_types``, ``no_rope_layers``, Gemma 3's RoPE per
layer type) <-> ``ModelConfig.layer_kinds`` / ``kinds`` (configs/layers.py).

Reading: each layer's (window, RoPE) pair; equal pairs share a kind; a model whose layers are all
alike gets no kinds at all (the model-level window and positions). Writing: each layer's resolved
kind, checked against what the HF format can say (one sliding_window value for all sliding
layers, one RoPE per layer type).
"""

from __future__ import annotations

from typing import Any

from ..configs import LayerKind, ModelConfig, RoPE
from ..models.kinds import ResolvedKind, resolve_kinds

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(hf: dict[str, Any], n: int, default: list[str], problems: list[str]) -> list[str]:
    """config.json's layer_types (or the family's default), checked: one known word per layer."""
    kinds = hf.get("layer_types") or default
    if len(kinds) != n or not set(kinds) <= {SLIDING, FULL}:
        problems.append(f"layer_types={kinds}: must be {n} entries of {[SLIDING, FULL]}")
        return [FULL] * n
    return list(kinds)


def kind_fields(windows: list[int | None], ropes: list[RoPE | None], positions: RoPE | None) -> dict[str, Any]:
    """ModelConfig fields for per-layer windows and RoPEs: sliding_window (for the attention
    config), positions, and layer_kinds/kinds when the layers differ."""
    pairs = list(zip(windows, ropes))
    if len(set(pairs)) == 1:
        return {"window": windows[0], "positions": ropes[0], "layer_kinds": None, "kinds": ()}
    names: dict[tuple, str] = {}
    for w, r in pairs:
        if (w, r) not in names:
            base = ("sliding" if w is not None else "full") + ("" if r is not None else "_nope")
            names[(w, r)] = base if base not in names.values() else f"{base}_{len(names)}"
    kinds = tuple(LayerKind(name=n, sliding_window=w, rope=r) for (w, r), n in names.items())
    return {"window": None, "positions": positions, "layer_kinds": tuple(names[p] for p in pairs), "kinds": kinds}


def per_layer(cfg: ModelConfig) -> list[ResolvedKind]:
    kinds, index = resolve_kinds(cfg, cfg.n_layers)
    return [kinds[i] for i in index]


def windows_to_hf(cfg: ModelConfig, problems: list[str]) -> tuple[list[str], int | None]:
    """(layer_types, the one sliding_window) of cfg's layers; several window sizes are a problem."""
    layers = per_layer(cfg)
    sizes = sorted({k.sliding_window for k in layers if k.sliding_window is not None})
    if len(sizes) > 1:
        problems.append(f"sliding windows {sizes}: config.json has one sliding_window for all sliding layers")
    return [SLIDING if k.sliding_window is not None else FULL for k in layers], (sizes[0] if sizes else None)


def ropes_by_type(cfg: ModelConfig, problems: list[str]) -> dict[str, RoPE | None]:
    """Gemma 3: the RoPE of each layer type; a type whose layers rotate differently is a problem."""
    out: dict[str, set] = {}
    for k in per_layer(cfg):
        out.setdefault(SLIDING if k.sliding_window is not None else FULL, set()).add(k.rope)
    for kind, ropes in out.items():
        if len(ropes) > 1:
            problems.append(f"{kind} layers use different RoPEs {sorted(map(repr, ropes))}: one per layer type")
    return {kind: next(iter(ropes)) for kind, ropes in out.items()}
