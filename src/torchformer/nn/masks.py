"""Dense boolean attention masks (True = may attend), built from positions.

Each is the rule of the same name in nn/patterns.py evaluated on index grids, so the dense masks
math/sdpa see and flex's mask_mod cannot drift. Masks are (B, 1, T, S) and broadcast over heads;
``padding_mask`` is (B, 1, 1, S). ``None`` means "no mask": the stack passes is_causal=True to the
backend instead when the plain lower triangle is exact (no cache, no padding, no window).
"""

from __future__ import annotations

from torch import Tensor

from . import patterns


def _rows(q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
    B = max(q_pos.shape[0], k_pos.shape[0])
    return q_pos.expand(B, -1), k_pos.expand(B, -1)  # (B, T), (B, S)


def causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Key j is visible to query i iff k_pos[j] <= q_pos[i].  (B, T), (B|1, S) -> (B, 1, T, S)."""
    q_pos, k_pos = _rows(q_pos, k_pos)
    return patterns.dense_mask(patterns.causal(q_pos, k_pos), *q_pos.shape, k_pos.shape[1], q_pos.device)


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Only the last ``window`` positions are visible (Mistral's sliding window)."""
    q_pos, k_pos = _rows(q_pos, k_pos)
    return patterns.dense_mask(patterns.window(q_pos, k_pos, window), *q_pos.shape, k_pos.shape[1], q_pos.device)


def padding_mask(valid: Tensor) -> Tensor:
    """Keys marked 0 in an attention_mask are never visible.  (B, S) -> (B, 1, 1, S)."""
    rule = patterns.key_valid(valid.bool())
    return patterns.dense_mask(rule, valid.shape[0], 1, valid.shape[1], valid.device, key_only=True)


def combine(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the masks that are present; None when none is."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out
