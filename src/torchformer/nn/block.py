"""A residual block: self-attention, optional cross-attention, MLP, each a residual sublayer.

Where the norm sits is chosen once at build time: pre-norm x + f(norm(x)) (GPT-2, Llama) or
post-norm norm(x + f(x)) (Vaswani 2017, BERT, BART).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .attention import Attention, AttnInputs

Residual = Callable[[Tensor, nn.Module, Callable[[Tensor], Tensor]], Tensor]


def pre_norm(x: Tensor, norm: nn.Module, f: Callable[[Tensor], Tensor]) -> Tensor:
    return x + f(norm(x))


def post_norm(x: Tensor, norm: nn.Module, f: Callable[[Tensor], Tensor]) -> Tensor:
    return norm(x + f(x))


class Block(nn.Module):
    def __init__(
        self,
        attn: Attention,
        attn_norm: nn.Module,
        mlp: nn.Module,
        mlp_norm: nn.Module,
        *,
        residual: Residual,
        dropout: nn.Module,
        cross_attn: Attention | None = None,
        cross_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.attn, self.attn_norm = attn, attn_norm
        self.cross_attn, self.cross_norm = cross_attn, cross_norm
        self.mlp, self.mlp_norm = mlp, mlp_norm
        self.residual = residual
        self.drop = dropout

    def forward(
        self,
        x: Tensor,
        ctx: AttnInputs,
        cache=None,
        cross_kv: tuple[Tensor, Tensor] | None = None,
        cross_ctx: AttnInputs | None = None,
    ) -> Tensor:
        x = self.residual(x, self.attn_norm, lambda h: self.drop(self.attn(h, ctx, cache)))
        if cross_kv is not None:
            x = self.residual(x, self.cross_norm, lambda h: self.drop(self.cross_attn.cross(h, cross_kv, cross_ctx)))
        return self.residual(x, self.mlp_norm, lambda h: self.drop(self.mlp(h)))
