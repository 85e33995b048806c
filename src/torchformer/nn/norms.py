"""LayerNorm (bias optional) and RMSNorm (reduction in fp32)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm with an optional bias (GPT-2/BERT keep it, some modern stacks drop it)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(dim, eps=eps, bias=bias)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019).

    The mean of squares is computed in fp32 whatever the input dtype: in fp16 the squares of
    ordinary activations overflow and in bf16 the sum loses most of its digits.
    """

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight
