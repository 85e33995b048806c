"""Accounting for expert MLPs and latent attention (accounting.py calls these when a config has
``moe`` or ``mla``): active parameters per token, matmul weights per layer, attention FLOPs and
the per-token cache of MLA against the per-head K/V it replaces. Arithmetic on the config only."""

from __future__ import annotations

from ..configs import GATED, ModelConfig, cache_widths
from ..models.kinds import resolve_kinds


def mlp_kinds(cfg: ModelConfig) -> list[str]:
    kinds, index = resolve_kinds(cfg, cfg.n_layers)
    return [kinds[i].mlp for i in index]


def active_params(numels: tuple[tuple[str, int], ...], cfg: ModelConfig) -> int:
    """Parameters one token uses: every tensor, but of the batched routed experts only top_k of
    n_experts (each expert tensor is (E, ...), so top_k / E of it is exact). Shared experts and
    routers always run."""
    if cfg.moe is None:
        return sum(n for _, n in numels)
    k, e = cfg.moe.top_k, cfg.moe.n_experts
    return sum(n * k // e if ".mlp.experts." in name else n for name, n in numels)


def attention_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one layer's attention matmuls: q, k, v, o, or MLA's q (full or low-rank),
    kv_down (D x (C + R)), kv_up (C x H (N + V)) and o (H V x D)."""
    d, h = cfg.d_model, cfg.attention.n_heads
    m = cfg.mla
    if m is None:
        e, kv = cfg.head_dim, cfg.n_kv_heads
        return 2 * d * h * e + 2 * d * kv * e
    q = d * h * m.qk_dim if m.q_rank is None else d * m.q_rank + m.q_rank * h * m.qk_dim
    return q + d * (m.kv_rank + m.rope_dim) + m.kv_rank * h * (m.nope_dim + m.v_dim) + h * m.v_dim * d


def mlp_matmul_params(cfg: ModelConfig, kind: str) -> int:
    """Weights one token multiplies in a layer's MLP: dense, or the router, its top_k experts and
    the shared experts (the active parameters of a sparse layer)."""
    d = cfg.d_model
    if kind == "dense":
        return (3 if cfg.block.mlp in GATED else 2) * d * cfg.d_ff
    m = cfg.moe
    shared = 3 * d * m.shared_width(cfg.d_ff) + (d if m.shared_gate else 0) if m.n_shared else 0
    return d * m.n_experts + m.top_k * 3 * d * m.expert_width(cfg.d_ff) + shared


def stack_matmul_params(cfg: ModelConfig) -> int:
    """Active matmul weights of the decoder's blocks, layer by layer (dense-first layers differ)."""
    attn = attention_matmul_params(cfg)
    return sum(attn + mlp_matmul_params(cfg, kind) for kind in mlp_kinds(cfg))


def attention_flops(cfg: ModelConfig, seq_len: int) -> int:
    """QK^T and AV per token and layer over seq_len keys: 2 T H (E_qk + E_v) (= 4 T H E with one E).
    MLA counts its per-head widths (nope + rope for scores, v_dim for values), as if expanded."""
    h, m = cfg.attention.n_heads, cfg.mla
    return 4 * seq_len * h * cfg.head_dim if m is None else 2 * seq_len * h * (m.qk_dim + m.v_dim)


def cache_numbers_per_token(cfg: ModelConfig) -> int:
    """Cached numbers per token and layer: 2 K E for K/V heads, C + R for MLA (latent + rotary key)."""
    heads, k, v = cache_widths(cfg)
    return heads * (k + v)


def expanded_cache_numbers(cfg: ModelConfig) -> int:
    """What MLA's cache replaces: per-head keys (N + R) and values (V) of every head."""
    m = cfg.mla
    return cfg.attention.n_heads * (m.qk_dim + m.v_dim)
