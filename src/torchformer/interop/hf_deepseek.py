"""DeepSeek-V3 (transformers' deepseek_v3): multi-head latent attention and DeepSeekMoE.

Attention (MLA): ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or one ``q_proj`` when
q_lora_rank is null), ``kv_a_proj_with_mqa`` = [latent ; rotary key], ``kv_a_layernorm`` on the
latent, ``kv_b_proj`` = per head [k_nope ; v]; rotary pairs interleaved (rope_interleave, the
default) or half-split; with yarn the softmax scale is multiplied by
(0.1 * mscale_all_dim * ln(factor) + 1) ** 2 (``mla.mscale``). MLP: the first
``first_k_dense_replace`` layers dense (intermediate_size), the rest experts: sigmoid router
``mlp.gate`` with the selection-only ``e_score_correction_bias``, n_group / topk_group limited
top-k, renormalised (norm_topk_prob) and scaled by routed_scaling_factor, plus n_shared_experts
shared experts as one MLP of n_shared_experts * moe_intermediate_size (``mlp.shared_experts``).
Multi-token-prediction layers (num_nextn_predict_layers) are not part of transformers' model and
are not read.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import AttentionConfig, LatentAttention, ModelConfig, MoE, RoPE, YaRN
from .hf_config import common_out, swiglu_block, token_ids, unsupported
from .hf_mixtral import (  # noqa: F401  (aliases: this family's, re-exported)
    aliases,
    expert_rules,
    generation_fields,
    model_rules,
    n_experts_of,
)
from .hf_qwen3_moe import EXPERT_NAMES, dense_layers, mlp_kinds
from .hf_rope import rope_from_hf, rope_to_hf, rope_unfit
from .keymap import KeyMap, renamed, rule

MODEL_TYPES = ("deepseek_v3",)
IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)


def yarn_mscale(rope: RoPE) -> float:
    """transformers' yarn_apply_mscale: the softmax-scale factor of a yarn RoPE with mscale_all_dim."""
    s = rope.scaling
    if not isinstance(s, YaRN) or not s.mscale_all_dim or s.factor <= 1:
        return 1.0
    return (0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0) ** 2


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    problems: list[str] = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported")
    rope, max_len = rope_from_hf(hf, problems)
    rope = RoPE(base=rope.base, pairing="interleaved" if hf.get("rope_interleave", True) else "half",
                scaling=rope.scaling)  # fmt: skip
    n_heads, n = hf["num_attention_heads"], hf["num_hidden_layers"]
    if (hf.get("num_key_value_heads") or n_heads) != n_heads:
        problems.append(f"num_key_value_heads={hf.get('num_key_value_heads')}: MLA needs it = num_attention_heads")
    n_experts = n_experts_of(hf)
    if n_experts is None:
        problems.append(f"n_routed_experts={n_experts!r}: a deepseek_v3 config needs the expert count")
    unsupported("deepseek_v3", problems)
    k, bias = hf.get("first_k_dense_replace", 0), hf.get("attention_bias", False)
    return ModelConfig(
        arch="decoder",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=n,
        max_seq_len=max_len,
        attention=AttentionConfig(n_heads=n_heads, bias=bias, dropout=hf.get("attention_dropout", 0.0)),
        block=swiglu_block(hf, 1e-6),
        positions=rope,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        moe=MoE(
            n_experts=n_experts,
            top_k=hf.get("num_experts_per_tok", 8),
            d_expert=hf["moe_intermediate_size"],
            router="sigmoid",
            renormalize=hf.get("norm_topk_prob", True),
            score_bias=True,
            n_groups=hf.get("n_group") or 1,
            topk_groups=hf.get("topk_group") or 1,
            routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
            n_shared=hf.get("n_shared_experts") or 0,
        ),  # fmt: skip
        mla=LatentAttention(
            kv_rank=hf["kv_lora_rank"],
            q_rank=hf.get("q_lora_rank"),
            nope_dim=hf["qk_nope_head_dim"],
            rope_dim=hf["qk_rope_head_dim"],
            v_dim=hf["v_head_dim"],
            mscale=yarn_mscale(rope),
        ),  # fmt: skip
        **mlp_kinds([i < k for i in range(n)]),
        **token_ids(hf, hf["vocab_size"]),
    )


def first_dense(cfg: ModelConfig) -> int:
    return len(dense_layers(cfg))


def unfit(cfg: ModelConfig) -> list[str]:
    b, a, m, mla = cfg.block, cfg.attention, cfg.moe, cfg.mla
    rules = [
        (cfg.arch == "decoder", f"arch={cfg.arch!r} (needs 'decoder')"),
        (b.norm == "rmsnorm" and b.norm_placement == "pre" and b.mlp == "swiglu" and not b.bias,
         "needs pre-norm RMSNorm and bias-free SwiGLU"),
        (mla is not None, "needs mla (latent attention)"),
        (m is not None, "needs moe (experts)"),
        (isinstance(cfg.positions, RoPE), "needs RoPE"),
        (cfg.has_final_norm and not (cfg.embed_scale or cfg.embed_norm or cfg.final_logits_bias),
         "needs a final norm and no embed_scale/embed_norm/logits bias"),
        (a.bias == a.o_bias, "attention_bias covers q_a, kv_a and o together"),
    ]  # fmt: skip
    problems = [why for ok, why in rules if not ok]
    if problems:
        return problems
    dense = dense_layers(cfg)
    rules = [
        (m.router == "sigmoid" and m.score_bias and not m.shared_gate, "needs a sigmoid router with score_bias"),
        (m.n_shared >= 1 and m.d_shared is None, "n_shared >= 1 shared experts, n_shared * d_expert wide"),
        (dense == list(range(len(dense))), f"dense layers {dense} must come first (first_k_dense_replace)"),
        (all(k.sliding_window == "inherit" and k.rope == "inherit" for k in cfg.kinds), "kinds differ only in mlp"),
        (math.isclose(mla.mscale, yarn_mscale(cfg.positions)), f"mla.mscale={mla.mscale} must follow the yarn RoPE"),
    ]
    return [why for ok, why in rules if not ok] + rope_unfit(cfg)


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    a, m, mla = cfg.attention, cfg.moe, cfg.mla
    out = common_out(cfg, dtype, "deepseek_v3", "DeepseekV3ForCausalLM")
    out.update(
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        moe_intermediate_size=m.expert_width(cfg.d_ff),
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_heads,
        hidden_act="silu",
        rms_norm_eps=cfg.block.norm_eps,
        attention_bias=a.bias,
        attention_dropout=a.dropout,
        n_routed_experts=m.n_experts,
        num_experts_per_tok=m.top_k,
        n_shared_experts=m.n_shared,
        n_group=m.n_groups,
        topk_group=m.topk_groups,
        norm_topk_prob=m.renormalize,
        routed_scaling_factor=m.routed_scale,
        first_k_dense_replace=first_dense(cfg),
        kv_lora_rank=mla.kv_rank,
        q_lora_rank=mla.q_rank,
        qk_nope_head_dim=mla.nope_dim,
        qk_rope_head_dim=mla.rope_dim,
        v_head_dim=mla.v_dim,
        head_dim=mla.rope_dim,
        rope_interleave=cfg.positions.pairing == "interleaved",
        num_nextn_predict_layers=0,
        **rope_to_hf(cfg),
    )
    return out, generation_fields(out)


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    L, H = "stack.blocks.{i}", "model.layers.{i}"
    A, S = f"{L}.attn", f"{H}.self_attn"
    q = [("q_proj", "q_proj")] if cfg.mla.q_rank is None else [("q_proj.down", "q_a_proj"), ("q_proj.up", "q_b_proj")]
    pairs = q + [("kv_down", "kv_a_proj_with_mqa"), ("kv_up", "kv_b_proj"), ("o_proj", "o_proj")]
    rules = model_rules() + renamed((f"{A}.{ours}", f"{S}.{theirs}") for ours, theirs in pairs)
    norms = [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
             ("attn.kv_norm", "self_attn.kv_a_layernorm"), ("attn.q_proj.norm", "self_attn.q_a_layernorm")]  # fmt: skip
    rules += renamed([(f"{L}.{ours}", f"{H}.{theirs}") for ours, theirs in norms], ("weight",))
    rules += renamed([(f"{L}.mlp.{ours}", f"{H}.mlp.{theirs}") for ours, theirs in EXPERT_NAMES.items()], ("weight",))
    rules += [rule(f"{L}.mlp.router.weight", f"{H}.mlp.gate.weight"),
              rule(f"{L}.mlp.router.score_bias", f"{H}.mlp.gate.e_score_correction_bias")]  # fmt: skip
    rules += expert_rules(cfg.moe.n_experts, f"{L}.mlp.experts", f"{H}.mlp.experts", EXPERT_NAMES)
    shared = [(f"{L}.mlp.shared.mlp.{a}", f"{H}.mlp.shared_experts.{b}") for a, b in EXPERT_NAMES.items()]
    return KeyMap(rules + renamed(shared, ("weight",)))
