"""Learning-rate schedules as plain functions of the step, set on the optimizer every step.

The lr is computed absolutely, never as a multiplier of the optimizer's construction lr: with
LambdaLR-style multipliers Noam's schedule silently depends on the lr the optimizer was built
with (the paper's formula has no base lr), and starting the count at 0 gives lr = 0 on the first
update. Here the first update is step 1 and its lr is the formula's value at t = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NAMES = ("noam", "cosine", "wsd", "constant")


@dataclass(frozen=True)
class Schedule:
    """lr(t) for the t-th optimizer update, t = 1, 2, ...

    name: noam | cosine | wsd | constant. lr: the peak lr (noam: ignored, see ``factor``).
    warmup: linear warm-up updates. total: planned updates. min_ratio: final lr / peak (cosine,
    wsd). decay_fraction: the share of ``total`` spent decaying at the end (wsd). d_model and
    factor: Noam's lr = factor * d_model^-0.5 * min(t^-0.5, t * warmup^-1.5).
    """

    name: str
    lr: float
    warmup: int
    total: int
    min_ratio: float = 0.1
    decay_fraction: float = 0.2
    d_model: int = 512
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"schedule.name={self.name!r}: must be one of {list(NAMES)}")
        if self.warmup < 0 or (self.name == "noam" and self.warmup < 1):
            raise ValueError(f"schedule.warmup={self.warmup}: must be >= 0 (>= 1 for noam)")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"schedule.min_ratio={self.min_ratio}: must be in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"schedule.decay_fraction={self.decay_fraction}: must be in (0, 1]")

    def __call__(self, t: int) -> float:
        if t < 1:
            raise ValueError(f"step t={t}: schedules count optimizer updates from 1")
        if self.name == "noam":  # Vaswani 2017, eq. 3
            return self.factor * self.d_model**-0.5 * min(t**-0.5, t * self.warmup**-1.5)
        if t <= self.warmup:
            return self.lr * t / self.warmup
        if self.name == "constant":
            return self.lr
        low = self.lr * self.min_ratio
        if self.name == "cosine":
            progress = min(1.0, (t - self.warmup) / max(1, self.total - self.warmup))
            return low + (self.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_start = self.total - int(self.decay_fraction * self.total)  # wsd: flat, then linear decay
        if t <= decay_start:
            return self.lr
        return self.lr - (self.lr - low) * min(1.0, (t - decay_start) / max(1, self.total - decay_start))

    def apply(self, optimizer: torch.optim.Optimizer, t: int) -> float:
        """Set the lr of every param group for update t (times the group's ``lr_ratio``: Muon's
        matrices run at their own multiple of optim.lr, optim.py); returns it."""
        lr = self(t)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)
        return lr
