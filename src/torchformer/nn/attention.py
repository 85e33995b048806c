"""Multi-head attention: MHA, GQA and MQA by the number of K/V heads; self and cross.

Legend: B batch, T query length, S key length, D model width, H query heads, K kv heads,
E head dim. Forward: project, rotate (if RoPE), write the cache (if any), attend, merge, project.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

from .linear import Linear
from .patterns import Pattern

Rotation = Callable[[Tensor, Tensor, Tensor], Tensor]


class AttnInputs(NamedTuple):
    """What the stack computes once per forward and hands to every layer. ``pattern`` holds the
    mask and bias rules (nn/patterns.py); the backend's prepare step (nn/routing.py) fills in
    the dense mask/bias or the flex block mask from it."""

    rope: tuple[Tensor, Tensor] | None  # cos, sin: (B, 1, T, E/2) each
    mask: Tensor | None  # (B, 1, T, S) bool, True = may attend
    bias: Tensor | None  # (B|1, H, T, S) additive score bias
    is_causal: bool  # the plain lower triangle, used only when mask is None
    slots: Tensor | None  # (B, T) cache slots to write this chunk's keys at
    pattern: Pattern | None = None  # the rules mask and bias come from (None: nothing beyond is_causal)
    by_kind: tuple = ()  # every layer kind's AttnInputs (Stack.context), indexed by the stack


class Attention(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        out_bias: bool,
        dropout: float,
        backend: Callable[..., Tensor],
        rotate: Rotation | None,
        scale: float | None = None,
        softcap: float | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(n_heads * head_dim, d_model, bias=out_bias)
        # Vaswani 2017, 3.2.1: 1/sqrt(E) keeps score variance ~1; T5 uses 1.0, Gemma 2
        # query_pre_attn_scalar ** -0.5 (AttentionConfig.scale).
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap  # Gemma 2: cap * tanh(score / cap), None for none
        self.dropout = dropout
        self.backend = backend
        self.rotate = rotate
        # QK-norm before RoPE (Qwen3, Gemma 3 per head; OLMo 2 over the width); Identity without.
        self.q_norm = nn.Identity() if q_norm is None else q_norm
        self.k_norm = nn.Identity() if k_norm is None else k_norm

    def split_heads(self, x: Tensor, n: int) -> Tensor:
        return x.unflatten(-1, (n, self.head_dim)).transpose(1, 2)  # (B, n, T, E)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of a source sequence (B, S, D) -> (B, K, S, E) each."""
        return self.split_heads(self.k_proj(memory), self.n_kv_heads), self.split_heads(
            self.v_proj(memory), self.n_kv_heads
        )

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q (B, T, H*E), k and v (B, T, K*E): the input projections, one product
        each (fast/joint.py runs them as one where the kernels' layout allows)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: Tensor, ctx: AttnInputs, cache=None) -> Tensor:
        """Self-attention of x (B, T, D) -> (B, T, D); cache is a LayerCache or None."""
        q, k, v = self.project(x)
        q = self.split_heads(self.q_norm(q), self.n_heads)  # (B, H, T, E)
        k = self.split_heads(self.k_norm(k), self.n_kv_heads)  # (B, K, T, E)
        v = self.split_heads(v, self.n_kv_heads)
        if ctx.rope is not None:
            q, k = self.rotate(q, *ctx.rope), self.rotate(k, *ctx.rope)
        if cache is not None:
            k, v = cache.write(k, v, ctx.slots)  # (B, K, S_max + 1, E)
        return self.attend(q, k, v, ctx)

    def cross(self, x: Tensor, kv: tuple[Tensor, Tensor], ctx: AttnInputs) -> Tensor:
        """Cross-attention of x (B, T, D) over precomputed source keys/values (B, K, S, E)."""
        q = self.split_heads(self.q_proj(x), self.n_heads)  # (B, H, T, E)
        return self.attend(q, *kv, ctx)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttnInputs) -> Tensor:
        out = self.backend(
            q,
            k,
            v,
            mask=ctx.mask,
            bias=ctx.bias,
            is_causal=ctx.is_causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            softcap=self.softcap,
            pattern=ctx.pattern,
        )  # (B, H, T, E)
        return self.o_proj(out.transpose(1, 2).flatten(2))  # (B, T, D)
