"""LoRALinear: a frozen linear plus a trainable low-rank update (Hu et al. 2021, "LoRA").

y = base(x) + (alpha / r) * B(A(dropout(x))), A (r, K), B (N, r). B starts at zero, so a freshly
wrapped model computes exactly what it computed before. A gets PEFT's default initialisation
(Kaiming-uniform with a = sqrt(5), as nn.Linear), so a PEFT adapter and ours start alike.

The base is any module mapping (..., K) -> (..., N): our Linear, or a weight-only quantized
linear (QLoRA-style: Dettmers et al. 2023, the update trains in float over an int8 base). The
base stays in eval mode whatever the wrapper's mode: it has no train-time behaviour of its own,
and the quantized linears refuse training mode.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..nn.linear import Linear


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.base_layer = base
        self.lora_A = Linear(self.in_features, rank, bias=False)
        self.lora_B = Linear(rank, self.out_features, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        like = next(iter(base.state_dict().values()))  # the base's device (its weight or integer buffer)
        self.lora_A.to(like.device)
        self.lora_B.to(like.device)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init_lora_weights=True
            nn.init.zeros_(self.lora_B.weight)  # B = 0: the update starts as an exact no-op
        for p in base.parameters():
            p.requires_grad_(False)
        base.train(False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base_layer(x)  # (..., N)
        a = self.lora_A(self.dropout(x))  # (..., r)
        # base + scaling * a B^T as one GEMM (alpha = scaling, beta = 1): no separate (..., N) update,
        # scaled copy and sum in forward, nor the scaled gradient in backward (the same values).
        out = torch.addmm(
            y.reshape(-1, self.out_features), a.reshape(-1, self.rank), self.lora_B.weight.t(), alpha=self.scaling
        )  # (rows, N)
        return out.view(y.shape)  # (..., N)

    def train(self, mode: bool = True) -> LoRALinear:
        super().train(mode)
        self.base_layer.train(False)  # see the module docstring
        return self

    @torch.no_grad()
    def delta(self) -> Tensor:
        """The update as a dense (N, K) matrix: scaling * B @ A."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling  # (N, r) @ (r, K)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


class FrozenQuantized(nn.Module):
    """A quantized linear LoRA does not adapt, kept in eval mode while the model trains (the
    quantized linears refuse training mode; frozen, they have nothing to train). merge unwraps it."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.base_layer = base.train(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.base_layer(x)

    def train(self, mode: bool = True) -> FrozenQuantized:
        super().train(mode)
        self.base_layer.train(False)
        return self
