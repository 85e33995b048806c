"""Layer kinds resolved for the builder: each kind's "inherit" fields replaced by the model's.

The config names kinds (configs/layers.py); building turns each distinct kind into one attention
context and one MLP choice (build.py), and interop/analysis read the same resolution so every
room agrees on which layer is which.
"""

from __future__ import annotations

from typing import NamedTuple

from ..configs import INHERIT, ModelConfig, RoPE


class ResolvedKind(NamedTuple):
    """A kind with every field decided: what the builder turns into modules."""

    sliding_window: int | None
    rope: RoPE | None
    mlp: str = "dense"  # "dense" or "moe"


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
