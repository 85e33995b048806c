"""The LM head with the two quirks some families put around the output projection."""

from __future__ import annotations

import torch
from torch import Tensor

from .linear import Linear


class LMHead(Linear):
    """logits = cap * tanh((scale * h) W^T / cap): ``scale`` multiplies the final hidden state
    (T5 ties its head and rescales by d_model ** -0.5), ``softcap`` bounds the logits (Gemma 2's
    final_logit_softcapping, 30). Either may be None. Same parameters and keys as nn.Linear."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, scale: float | None, softcap: float | None) -> None:
        super().__init__(d_in, d_out, bias=bias)
        self.scale = 1.0 if scale is None else scale
        self.softcap = softcap

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x * self.scale if self.scale != 1.0 else x)
        if self.softcap is None:
            return logits
        return self.softcap * torch.tanh(logits / self.softcap)
