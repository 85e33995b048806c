"""A residual block: self-attention, optional cross-attention, MLP, each a residual sublayer.

How the sublayers meet the residual stream is chosen once at build time (RESIDUALS in
models/build.py), as a function of the block input and its (norm, f) sublayers in order:
pre-norm x + f(norm(x)) in turn (GPT-2, Llama), post-norm norm(x + f(x)) in turn (Vaswani 2017,
BERT, BART), or parallel, where every sublayer reads the block input and the outputs are summed
(GPT-J, GPT-NeoX use_parallel_residual, PaLM section 2).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .attention import Attention, AttnInputs

Sublayer = tuple[nn.Module, Callable[[Tensor], Tensor]]  # (its norm, the sublayer)
Residual = Callable[[Tensor, list[Sublayer]], Tensor]


def pre_norm(x: Tensor, sublayers: list[Sublayer]) -> Tensor:
    for norm, f in sublayers:
        x = x + f(norm(x))
    return x


def post_norm(x: Tensor, sublayers: list[Sublayer]) -> Tensor:
    for norm, f in sublayers:
        x = norm(x + f(x))
    return x


def parallel(x: Tensor, sublayers: list[Sublayer]) -> Tensor:
    """x + attn(norm1 x) + mlp(norm2 x): one residual add per block (GPT-NeoX, Pythia)."""
    out = x
    for norm, f in sublayers:
        out = out + f(norm(x))
    return out


def parallel_shared(x: Tensor, sublayers: list[Sublayer]) -> Tensor:
    """x + attn(n x) + mlp(n x) with the first sublayer's norm only (GPT-J, Phi-2: one ln_1);
    build gives the other sublayers nn.Identity, so no unused weights exist."""
    h, out = sublayers[0][0](x), x
    for _, f in sublayers:
        out = out + f(h)
    return out


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
        attn_out_norm: nn.Module | None = None,
        mlp_out_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.attn, self.attn_norm = attn, attn_norm
        self.cross_attn, self.cross_norm = cross_attn, cross_norm
        self.mlp, self.mlp_norm = mlp, mlp_norm
        self.residual = residual
        self.drop = dropout
        # A norm on a sublayer's output before the residual add (Gemma 2/3 sandwich, OLMo 2);
        # Identity where the placement has none.
        self.attn_out_norm = nn.Identity() if attn_out_norm is None else attn_out_norm
        self.mlp_out_norm = nn.Identity() if mlp_out_norm is None else mlp_out_norm

    def forward(
        self,
        x: Tensor,
        ctx: AttnInputs,
        cache=None,
        cross_kv: tuple[Tensor, Tensor] | None = None,
        cross_ctx: AttnInputs | None = None,
    ) -> Tensor:
        sublayers = [(self.attn_norm, lambda h: self.drop(self.attn_out_norm(self.attn(h, ctx, cache))))]
        if cross_kv is not None:
            sublayers.append((self.cross_norm, lambda h: self.drop(self.cross_attn.cross(h, cross_kv, cross_ctx))))
        sublayers.append((self.mlp_norm, lambda h: self.drop(self.mlp_out_norm(self.mlp(h)))))
        return self.residual(x, sublayers)
