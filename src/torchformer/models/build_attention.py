"""Attention words -> functions and modules (split from build.py by concern): the backend
table, what each backend's per-forward context needs, where flex can run, and QK-norm."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from ..configs import ModelConfig
from ..nn import flex
from ..nn.backends import math_attention, sdpa_attention
from ..nn.norms import PerHead
from ..nn.routing import auto_attention, auto_preparer, prepare_dense, prepare_flex

BACKENDS = {"math": math_attention, "sdpa": sdpa_attention, "flex": flex.flex_attention, "auto": auto_attention}
PREPARES = {  # backend word -> what its context needs, built once per forward (nn/routing.py)
    "math": lambda softcap, flex_ok: prepare_dense,
    "sdpa": lambda softcap, flex_ok: prepare_dense,
    "flex": lambda softcap, flex_ok: prepare_flex,
    "auto": auto_preparer,
}
# qk_norm word -> the norm applied to a (B, T, n * E) projection before RoPE, given the block's
# norm maker and (n, E). "head": over each head's E features, one E-wide weight (Qwen3, Gemma 3);
# "width": over all n * E features, an n * E-wide weight (OLMo 2).
QK_NORMS: dict[str | None, Callable[[Callable[[int], nn.Module], int, int], nn.Module]] = {
    None: lambda make, n, e: nn.Identity(),
    "head": lambda make, n, e: PerHead(make(e), e),
    "width": lambda make, n, e: make(n * e),
}


def qk_norms(cfg: ModelConfig, make: Callable[[int], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """The q and k norms (Identity without qk_norm); ``make(width)`` builds the block's norm kind."""
    pick = QK_NORMS[cfg.attention.qk_norm]
    return pick(make, cfg.attention.n_heads, cfg.head_dim), pick(make, cfg.n_kv_heads, cfg.head_dim)


def flex_runs(backend: str) -> bool:
    """Whether flex can run here: "flex" forced where it cannot is an error, "auto" warns once
    and keeps to the dense paths."""
    reason = flex.unavailable_reason(torch.get_default_device()) if backend in ("flex", "auto") else None
    if reason is not None and backend == "flex":
        raise ValueError(f"attention.backend='flex' cannot run here: {reason}; use 'auto', 'sdpa' or 'math'")
    if reason is not None:
        warnings.warn(f"attention.backend='auto' will not use flex: {reason}", stacklevel=4)
    return reason is None


def prepare(cfg: ModelConfig) -> Callable:
    return PREPARES[cfg.attention.backend](cfg.attention.softcap, flex_runs(cfg.attention.backend))
