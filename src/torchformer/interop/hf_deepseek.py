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

from ..configs import RoPE, YaRN
from .family import Family, Field, Rule, module_functions
from .hf_rope import rope_from_hf, rope_to_hf
from .keymap import KeyMap, renamed, rule
from .layouts import (
    D_FF,
    LLAMA_FIXED,
    ROTARY_BUFFER,
    SHAPE,
    SWIGLU,
    SWIGLU_NAMES,
    L,
    dense_layers,
    dense_rule,
    expert_count,
    expert_rules,
    needs_rope,
    tied,
    trunk_ends,
)


def yarn_mscale(rope: RoPE) -> float:
    """transformers' yarn_apply_mscale: the softmax-scale factor of a yarn RoPE with mscale_all_dim."""
    s = rope.scaling
    if not isinstance(s, YaRN) or not s.mscale_all_dim or s.factor <= 1:
        return 1.0
    return (0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0) ** 2


def read_rope(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    """RoPE over the rope_dim features, pairs as rope_interleave says; the MLA scale follows it."""
    rope, values["max_seq_len"] = rope_from_hf(hf, problems)
    pairing = "interleaved" if hf.get("rope_interleave", True) else "half"
    values["positions"] = RoPE(base=rope.base, pairing=pairing, scaling=rope.scaling)
    values["mla.mscale"] = yarn_mscale(values["positions"])
    n_heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or n_heads) != n_heads:
        problems.append(f"num_key_value_heads={hf.get('num_key_value_heads')}: MLA needs it = num_attention_heads")


def write_rope(cfg, out: dict[str, Any]) -> None:
    out.update(rope_to_hf(cfg), rope_interleave=cfg.positions.pairing == "interleaved")
    out.update(num_key_value_heads=cfg.attention.n_heads, head_dim=cfg.mla.rope_dim, num_nextn_predict_layers=0)


def needs_mla(cfg) -> list[str]:
    return needs_rope(cfg) + ([] if cfg.mla is not None else ["needs mla (latent attention)"])


def keymap(cfg, hf_names=None) -> KeyMap:
    H = "model.layers.{i}"
    q = [("q_proj", "q_proj")] if cfg.mla.q_rank is None else [("q_proj.down", "q_a_proj"), ("q_proj.up", "q_b_proj")]
    attn = q + [("kv_down", "kv_a_proj_with_mqa"), ("kv_up", "kv_b_proj"), ("o_proj", "o_proj")]
    rules = trunk_ends() + renamed((f"{L}.attn.{ours}", f"{H}.self_attn.{theirs}") for ours, theirs in attn)
    pairs = [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
             ("attn.kv_norm", "self_attn.kv_a_layernorm"), ("attn.q_proj.norm", "self_attn.q_a_layernorm"),
             ("mlp.router", "mlp.gate")]  # fmt: skip
    pairs += [(f"mlp.{a}", f"mlp.{b}") for a, b in SWIGLU_NAMES.items()]
    pairs += [(f"mlp.shared.mlp.{a}", f"mlp.shared_experts.{b}") for a, b in SWIGLU_NAMES.items()]
    rules += renamed([(f"{L}.{ours}", f"{H}.{theirs}") for ours, theirs in pairs], ("weight",))
    rules.append(rule(f"{L}.mlp.router.score_bias", f"{H}.mlp.gate.e_score_correction_bias"))
    return KeyMap(rules + expert_rules(cfg.moe.n_experts, f"{L}.mlp.experts", f"{H}.mlp.experts", SWIGLU_NAMES))


DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    fields=(
        *SHAPE,
        D_FF,
        Field("rms_norm_eps", "block.norm_eps", 1e-6),
        Field("attention_bias", "attention.bias", False),
        Field("attention_dropout", "attention.dropout", 0.0),
        Field("tie_word_embeddings", "tie_embeddings", False),
        SWIGLU,
        expert_count("n_routed_experts"),
        Field("num_experts_per_tok", "moe.top_k", 8),
        Field("moe_intermediate_size", "moe.d_expert"),
        Field("norm_topk_prob", "moe.renormalize", True),
        Field("n_group", "moe.n_groups", 1, empty=True),
        Field("topk_group", "moe.topk_groups", 1, empty=True),
        Field("routed_scaling_factor", "moe.routed_scale", 1.0, read=lambda v, hf: float(v)),
        Field("n_shared_experts", "moe.n_shared", 0, empty=True),
        Field("kv_lora_rank", "mla.kv_rank"),
        Field("q_lora_rank", "mla.q_rank", None),
        Field("qk_nope_head_dim", "mla.nope_dim"),
        Field("qk_rope_head_dim", "mla.rope_dim"),
        Field("v_head_dim", "mla.v_dim"),
    ),
    keys=keymap,
    rules=(
        Rule("latent attention", read_rope, write_rope, needs_mla),
        dense_rule(
            lambda hf: [i < hf.get("first_k_dense_replace", 0) for i in range(hf["num_hidden_layers"])],
            lambda cfg, out: out.update(first_k_dense_replace=len(dense_layers(cfg))),
        ),
    ),  # fmt: skip
    fixed={**LLAMA_FIXED, "moe.router": "sigmoid", "moe.score_bias": True},
    ignored=(ROTARY_BUFFER,),
    aliases=tied("model.embed_tokens.weight"),
)
FAMILIES = (DEEPSEEK_V3,)
config_from_hf, config_to_hf = module_functions(*FAMILIES)
