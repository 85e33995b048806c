"""Per-head statistics of attention weights: entropy, max attention, mean attention distance.

Legend: B batch, H heads, T queries, S keys. A head that attends to one key has entropy 0 and
max 1; a uniform head over n keys has entropy ln(n) and max 1/n. Distance is sum_j a_ij |i - j|
with query i aligned to the last keys (i + S - T), as in causal decoding with a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class HeadStats:
    """Means over the counted query rows, one value per head: (H,) each."""

    entropy: Tensor  # nats
    max_weight: Tensor
    distance: Tensor  # keys

    def rows(self) -> list[tuple[int, float, float, float]]:
        """(head, entropy, max_weight, distance) per head, for tables."""
        return [
            (h, float(self.entropy[h]), float(self.max_weight[h]), float(self.distance[h]))
            for h in range(self.entropy.shape[0])
        ]


def _query_weight(weights: Tensor, mask: Tensor | None) -> Tensor:
    """(B, 1|H, T) 1.0 for query rows to count: rows marked real in mask that see some key."""
    counted = weights.sum(-1) > 0  # fully masked rows (all zero) carry no distribution
    if mask is not None:
        if mask.dim() != 2 or mask.shape[0] != weights.shape[0] or mask.shape[1] != weights.shape[2]:
            raise ValueError(
                f"mask has shape {tuple(mask.shape)}; expected (B, T) = {(weights.shape[0], weights.shape[2])}"
            )
        counted = counted & mask.bool()[:, None, :]
    return counted.float()


def head_stats(weights: Tensor, mask: Tensor | None = None) -> HeadStats:
    """Per-head mean entropy, max attention and attention distance of weights (B, H, T, S).

    mask (B, T): 1 for real query tokens, 0 for padding; padded query rows are excluded, and
    masked keys are excluded by carrying zero weight. Rows that see no key are never counted.
    """
    if not isinstance(weights, Tensor) or weights.dim() != 4:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a (B, H, T, S) tensor, got {shape}")
    w = weights.float()
    B, H, T, S = w.shape
    count = _query_weight(w, mask).expand(B, H, T)  # (B, H, T)
    # 0 * log 0 = 0: masked keys (exact zeros) contribute nothing.
    entropy = -(w * w.clamp_min(torch.finfo(w.dtype).tiny).log()).sum(-1)  # (B, H, T)
    top = w.amax(-1)  # (B, H, T)
    q_idx = torch.arange(T, device=w.device)[:, None] + (S - T)
    offsets = (q_idx - torch.arange(S, device=w.device)[None, :]).abs().float()  # (T, S)
    distance = (w * offsets).sum(-1)  # (B, H, T)
    n = count.sum(dim=(0, 2)).clamp_min(1)  # (H,)

    def mean(x: Tensor) -> Tensor:
        return (x * count).sum(dim=(0, 2)) / n

    return HeadStats(entropy=mean(entropy), max_weight=mean(top), distance=mean(distance))
