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


class OffsetRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + weight), all in fp32, cast back at the end; the
    weight starts at 0 (Gemma 1/2/3: GemmaRMSNorm, a checkpoint stores w, not 1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class PerHead(nn.Module):
    """A norm over each head's E features of a projection (B, T, n * E) (QK-norm of Qwen3 and
    Gemma 3, whose q_norm/k_norm weights have head_dim entries shared by all heads)."""

    def __init__(self, norm: nn.Module, head_dim: int) -> None:
        super().__init__()
        self.norm, self.head_dim = norm, head_dim

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)  # (B, T, n, E) -> (B, T, n * E)
