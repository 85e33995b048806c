"""Multi-head latent attention (MLA; DeepSeek-V2 section 2.1, DeepSeek-V3 section 2.1.1).

Legend: B batch, T query length, S key length, D model width, H heads, C kv latent rank,
R rotary width per head (shared key), N non-rotary q/k width per head, V value width per head.

Keys and values come from one latent c = RMSNorm(W_dkv x) (B, T, C) plus a single rotary key
k_r = RoPE(W_kr x) (B, T, R) shared by every head: head h's key is [W_uk,h c ; k_r], its value
W_uv,h c. The cache stores only (c, k_r): C + R numbers per token and layer instead of
H * (N + R + V). Without a cache (training, a full forward) keys and values are expanded per head.
With one, the up-projections are absorbed (DeepSeek-V2, appendix "absorb"): q_h . W_uk,h c =
(W_uk,h^T q_h) . c, so every head attends over the shared latent directly (one K/V "head", MQA
shape) and W_uv,h is applied to the attended latent afterwards; the cache is never expanded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .attention import AttnInputs, Rotation
from .linear import Linear
from .norms import RMSNorm


class LatentAttention(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_rank: int,
        q_rank: int | None,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        bias: bool,
        dropout: float,
        backend: Callable[..., Tensor],
        rotate: Rotation | None,
        scale: float,
    ) -> None:
        super().__init__()
        self.n_heads, self.kv_rank, self.v_dim = n_heads, kv_rank, v_dim
        self.nope_dim, self.rope_dim = nope_dim, rope_dim
        qk = nope_dim + rope_dim
        # q: full rank (DeepSeek-V2-Lite) or through a rank-q_rank bottleneck with its own norm.
        if q_rank is None:
            self.q_proj = Linear(d_model, n_heads * qk, bias=False)
        else:
            parts = {"down": Linear(d_model, q_rank, bias=bias), "norm": RMSNorm(q_rank, eps=1e-6),
                     "up": Linear(q_rank, n_heads * qk, bias=False)}  # fmt: skip
            self.q_proj = nn.Sequential(OrderedDict(parts))
        self.kv_down = Linear(d_model, kv_rank + rope_dim, bias=bias)  # [latent ; rotary key]
        self.kv_norm = RMSNorm(kv_rank, eps=1e-6)
        self.kv_up = Linear(kv_rank, n_heads * (nope_dim + v_dim), bias=False)  # per head [W_uk ; W_uv]
        self.o_proj = Linear(n_heads * v_dim, d_model, bias=bias)
        self.scale = scale  # (N + R) ** -0.5, times the yarn mscale factor (LatentAttention.mscale)
        self.dropout, self.backend, self.rotate = dropout, backend, rotate

    def forward(self, x: Tensor, ctx: AttnInputs, cache=None) -> Tensor:
        """Self-attention of x (B, T, D) -> (B, T, D); cache a LayerCache holding (latent, rotary key)."""
        q_nope, q_rope, c, k_rope = self.project(x, ctx)
        if cache is None:
            return self.expanded(q_nope, q_rope, c, k_rope, ctx)
        c, k_rope = cache.write(c, k_rope, ctx.slots)  # (B, 1, S_max + 1, C), (B, 1, S_max + 1, R)
        return self.absorbed(q_nope, q_rope, c, k_rope, ctx)

    def project(self, x: Tensor, ctx: AttnInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q_nope (B, H, T, N), q_rope (B, H, T, R) turned, latent (B, 1, T, C),
        rotary key (B, 1, T, R) turned."""
        q = self.q_proj(x).unflatten(-1, (self.n_heads, -1)).transpose(1, 2)  # (B, H, T, N + R)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (B, T, C), (B, T, R)
        c, k_rope = self.kv_norm(c)[:, None], k_rope[:, None]  # (B, 1, T, C), (B, 1, T, R)
        if ctx.rope is not None:
            q_rope, k_rope = self.rotate(q_rope, *ctx.rope), self.rotate(k_rope, *ctx.rope)
        return q_nope, q_rope, c, k_rope

    def expanded(self, q_nope: Tensor, q_rope: Tensor, c: Tensor, k_rope: Tensor, ctx: AttnInputs) -> Tensor:
        """Per-head keys [W_uk c ; k_r] and values W_uv c, then ordinary attention."""
        kv = self.kv_up(c[:, 0]).unflatten(-1, (self.n_heads, -1)).transpose(1, 2)  # (B, H, S, N + V)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)  # (B, H, S, N + R)
        return self.attend(torch.cat([q_nope, q_rope], dim=-1), k, v, ctx)

    def absorbed(self, q_nope: Tensor, q_rope: Tensor, c: Tensor, k_rope: Tensor, ctx: AttnInputs) -> Tensor:
        """Attention over the latent itself: q_h W_uk,h against c, then W_uv,h on the result."""
        w_uk, w_uv = self.kv_up.weight.view(self.n_heads, -1, self.kv_rank).split([self.nope_dim, self.v_dim], 1)
        q = torch.cat([q_nope @ w_uk, q_rope], dim=-1)  # (B, H, T, N) @ (H, N, C) -> (B, H, T, C + R)
        k = torch.cat([c, k_rope], dim=-1)  # (B, 1, S, C + R): one key head shared by all
        out = self.backend(
            q,
            k,
            c,
            mask=ctx.mask,
            bias=ctx.bias,
            is_causal=ctx.is_causal,
            scale=self.scale,
            dropout_p=0.0,
            softcap=None,
            pattern=ctx.pattern,
        )  # fmt: skip  (B, H, T, C)
        return self.merge(out @ w_uv.transpose(1, 2))  # (B, H, T, C) @ (H, C, V) -> (B, H, T, V)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttnInputs) -> Tensor:
        out = self.backend(q, k, v, mask=ctx.mask, bias=ctx.bias, is_causal=ctx.is_causal, scale=self.scale,
                           dropout_p=self.dropout if self.training else 0.0, softcap=None,
                           pattern=ctx.pattern)  # fmt: skip
        return self.merge(out)  # (B, H, T, V)

    def merge(self, out: Tensor) -> Tensor:
        return self.o_proj(out.transpose(1, 2).flatten(2))  # (B, H, T, V) -> (B, T, D)
