"""Boolean attention masks (True = may attend), built from positions.

Masks are (B, 1, T, S) and broadcast over heads. ``None`` means "no mask": the stack passes
is_causal=True to the backend instead when the plain lower triangle is exact (no cache, no
padding, no window), which lets SDPA use its fastest kernel.
"""

from __future__ import annotations

from torch import Tensor


def causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Key j is visible to query i iff k_pos[j] <= q_pos[i].  (B, T), (B|1, S) -> (B, 1, T, S)."""
    return k_pos[:, None, None, :] <= q_pos[:, None, :, None]


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """Only the last ``window`` positions are visible (Mistral's sliding window)."""
    return (q_pos[:, None, :, None] - k_pos[:, None, None, :]) < window


def padding_mask(valid: Tensor) -> Tensor:
    """Keys marked 0 in an attention_mask are never visible.  (B, S) -> (B, 1, 1, S)."""
    return valid.bool()[:, None, None, :]


def combine(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the masks that are present; None when none is."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out
