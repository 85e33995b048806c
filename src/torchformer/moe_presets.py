"""Mixture-of-experts presets as data (presets.py lists them). Shapes follow the published
config.json files; tests check the totals on the meta device (Mixtral 8x7B 46.7B, DeepSeek-V3
671B without its multi-token-prediction layer)."""

from __future__ import annotations

import math

from .configs import (
    AttentionConfig,
    BlockConfig,
    LatentAttention,
    LayerKind,
    ModelConfig,
    MoE,
    RoPE,
    YaRN,
    layer_pattern,
)


def _mixtral_8x7b() -> ModelConfig:
    """mistralai/Mixtral-8x7B-v0.1: Mistral 7B's attention (GQA 32:8, RoPE base 1e6) with 8 SwiGLU
    experts of 14336, top-2, in every layer."""
    return ModelConfig(
        arch="decoder",
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        max_seq_len=32768,
        attention=AttentionConfig(n_heads=32, n_kv_heads=8),
        block=BlockConfig(norm="rmsnorm", norm_eps=1e-5, norm_placement="pre", mlp="swiglu", d_ff=14336),
        positions=RoPE(base=1e6),
        tie_embeddings=False,
        moe=MoE(n_experts=8, top_k=2),
        bos_token_id=1,
        eos_token_id=2,
    )


def _deepseek_v3() -> ModelConfig:
    """deepseek-ai/DeepSeek-V3: 61 layers, the first 3 dense (18432), then 256 routed experts of
    2048 (top-8 within the best 4 of 8 groups, sigmoid, scale 2.5) plus one shared; MLA with
    q_rank 1536, kv_rank 512, 128 + 64 q/k and 128 v per head; yarn x40 from 4096 (mscale_all_dim 1)."""
    yarn = YaRN(factor=40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    return ModelConfig(
        arch="decoder",
        vocab_size=129280,
        d_model=7168,
        n_layers=61,
        max_seq_len=163840,
        attention=AttentionConfig(n_heads=128),
        block=BlockConfig(norm="rmsnorm", norm_eps=1e-6, norm_placement="pre", mlp="swiglu", d_ff=18432),
        positions=RoPE(base=10000.0, pairing="interleaved", scaling=yarn),
        tie_embeddings=False,
        moe=MoE(
            n_experts=256,
            top_k=8,
            d_expert=2048,
            router="sigmoid",
            renormalize=True,
            score_bias=True,
            n_groups=8,
            topk_groups=4,
            routed_scale=2.5,
            n_shared=1,
        ),  # fmt: skip
        mla=LatentAttention(
            kv_rank=512, q_rank=1536, nope_dim=128, rope_dim=64, v_dim=128, mscale=(0.1 * math.log(40.0) + 1.0) ** 2
        ),  # fmt: skip
        layer_kinds=("dense",) * 3 + ("moe",) * 58,
        kinds=(LayerKind(name="dense", mlp="dense"), LayerKind(name="moe", mlp="moe")),
        bos_token_id=0,
        eos_token_id=1,
    )


def _moe_tiny() -> ModelConfig:
    """~1.5M parameters: 8 experts top-2, the first layer dense. For tests, demos and benchmarks."""
    return ModelConfig(
        arch="decoder",
        vocab_size=256,
        d_model=128,
        n_layers=4,
        max_seq_len=512,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
        block=BlockConfig(norm="rmsnorm", norm_placement="pre", mlp="swiglu", d_ff=256),
        positions=RoPE(),
        moe=MoE(n_experts=8, top_k=2, d_expert=128),
        layer_kinds=layer_pattern(("dense", "moe", "moe", "moe"), 4),
        kinds=(LayerKind(name="dense", mlp="dense"), LayerKind(name="moe", mlp="moe")),
    )


MOE_PRESETS = {"mixtral-8x7b": _mixtral_8x7b, "deepseek-v3": _deepseek_v3, "moe-tiny": _moe_tiny}
