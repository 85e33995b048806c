"""Qwen3-MoE and Qwen2-MoE: the Llama layout with expert MLPs (``mlp.gate`` router, per-expert
``gate_proj/up_proj/down_proj`` of width moe_intermediate_size), softmax top-k renormalised only
with ``norm_topk_prob``. Qwen3-MoE adds per-head RMSNorm on q and k (q_norm, k_norm) and optional
attention biases on all four projections; Qwen2-MoE has q/k/v biases (qkv_bias, no o bias) and
one shared expert of width shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate x).
A layer is dense (an MLP of intermediate_size) when it is in mlp_only_layers or when
(i + 1) % decoder_sparse_step != 0: those become a "dense" layer kind (layer_configs.py).
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, LayerKind, ModelConfig, MoE
from ..layer_configs import resolve_kinds
from .hf_config import common_out, swiglu_block, token_ids, unsupported
from .hf_mixtral import (  # noqa: F401  (aliases: this family's, re-exported)
    aliases,
    attention_rules,
    expert_rules,
    generation_fields,
    head_dim_of,
    llama_layout_unfit,
    model_rules,
    n_experts_of,
)
from .hf_rope import rope_from_hf, rope_to_hf
from .keymap import KeyMap, renamed, rule
from .transforms import half_to_interleaved, interleaved_to_half

MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
DENSE, SPARSE = LayerKind(name="dense", mlp="dense"), LayerKind(name="moe", mlp="moe")


def mlp_kinds(dense: list[bool]) -> dict[str, Any]:
    """layer_kinds / kinds for layers whose MLP is dense (True) or experts (False); none if all are experts."""
    if not any(dense):
        return {"layer_kinds": None, "kinds": ()}
    names = tuple("dense" if d else "moe" for d in dense)
    return {"layer_kinds": names, "kinds": tuple(k for k in (DENSE, SPARSE) if k.name in names)}


def dense_layers(cfg: ModelConfig) -> list[int]:
    kinds, index = resolve_kinds(cfg, cfg.n_layers)
    return [i for i, k in enumerate(index) if kinds[k].mlp == "dense"]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type, problems = hf["model_type"], []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r}: only 'silu' (SwiGLU) is supported")
    if hf.get("use_sliding_window", False):
        problems.append("use_sliding_window=True: not supported for the Qwen-MoE families")
    rope, max_len = rope_from_hf(hf, problems)
    n_experts, n = n_experts_of(hf), hf["num_hidden_layers"]
    if n_experts is None:
        problems.append(f"num_experts={n_experts!r}: a {model_type} config needs the expert count")
    unsupported(model_type, problems)
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    dense = [i in only or (i + 1) % step != 0 for i in range(n)]
    qwen2 = model_type == "qwen2_moe"
    shared = hf.get("shared_expert_intermediate_size") if qwen2 else None
    bias = hf.get("qkv_bias", True) if qwen2 else hf.get("attention_bias", False)
    return ModelConfig(
        arch="decoder",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=n,
        max_seq_len=max_len,
        attention=AttentionConfig(
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim_of(hf),
            bias=bias,
            out_bias=bias and not qwen2,
            dropout=hf.get("attention_dropout", 0.0),
            qk_norm=None if qwen2 else "head",  # Qwen3: RMSNorm over each head's features before RoPE
        ),
        block=swiglu_block(hf, 1e-6),
        positions=rope,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        moe=MoE(
            n_experts=n_experts,
            top_k=hf.get("num_experts_per_tok", 2),
            d_expert=hf["moe_intermediate_size"],
            renormalize=hf.get("norm_topk_prob", False),
            n_shared=1 if shared else 0,
            d_shared=shared or None,
            shared_gate=bool(shared),
        ),  # fmt: skip
        **mlp_kinds(dense),
        **token_ids(hf, hf["vocab_size"]),
    )


def model_type_for(cfg: ModelConfig) -> str:
    return "qwen2_moe" if cfg.moe is not None and cfg.moe.n_shared else "qwen3_moe"


def unfit(cfg: ModelConfig) -> list[str]:
    problems = llama_layout_unfit(cfg)
    m, a = cfg.moe, cfg.attention
    if m is None:
        return problems
    qwen2 = model_type_for(cfg) == "qwen2_moe"
    rules = [
        (m.router == "softmax" and not m.score_bias and m.n_groups == 1 and m.routed_scale == 1,
         "needs a softmax router without bias, groups or scale"),
        (m.n_shared == 0 or (m.n_shared == 1 and m.shared_gate), "at most one shared expert, sigmoid-gated"),
        (a.sliding_window is None, "no sliding window"),
        (a.qk_norm == (None if qwen2 else "head"), "qwen3_moe needs qk_norm='head'; qwen2_moe has none"),
        (not qwen2 or (a.bias and not a.o_bias), "qwen2_moe has q/k/v biases and no o bias"),
        (qwen2 or a.bias == a.o_bias, "qwen3_moe biases all four projections or none"),
        (all(k.sliding_window == "inherit" and k.rope == "inherit" for k in cfg.kinds), "kinds differ only in mlp"),
    ]  # fmt: skip
    return problems + [why for ok, why in rules if not ok]


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    model_type, a, m = model_type_for(cfg), cfg.attention, cfg.moe
    out = common_out(cfg, dtype, model_type, ARCHITECTURES[model_type])
    out.update(
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        moe_intermediate_size=m.expert_width(cfg.d_ff),
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.block.norm_eps,
        attention_dropout=a.dropout,
        num_experts=m.n_experts,
        num_experts_per_tok=m.top_k,
        norm_topk_prob=m.renormalize,
        decoder_sparse_step=1,
        mlp_only_layers=dense_layers(cfg),
        use_sliding_window=False,
        **rope_to_hf(cfg),
    )
    if model_type == "qwen2_moe":
        out.update(qkv_bias=a.bias, shared_expert_intermediate_size=m.shared_width(cfg.d_ff))
    else:
        out.update(attention_bias=a.bias)
    return out, generation_fields(out)


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    L, H = "stack.blocks.{i}", "model.layers.{i}"
    rules = model_rules() + attention_rules(cfg, L, H)
    for norm in ("q_norm", "k_norm"):  # one head's features: permuted like one head of q/k rows
        if cfg.positions.pairing == "interleaved":
            ours, theirs = (lambda ts: [half_to_interleaved(ts[0], 1)]), (lambda ts: [interleaved_to_half(ts[0], 1)])
            rules.append(rule(f"{L}.attn.{norm}.norm.weight", f"{H}.self_attn.{norm}.weight", ours, theirs))
        else:
            rules.append(rule(f"{L}.attn.{norm}.norm.weight", f"{H}.self_attn.{norm}.weight"))
    rules += renamed([(f"{L}.mlp.{ours}", f"{H}.mlp.{theirs}") for ours, theirs in EXPERT_NAMES.items()], ("weight",))
    rules.append(rule(f"{L}.mlp.router.weight", f"{H}.mlp.gate.weight"))
    rules += expert_rules(cfg.moe.n_experts, f"{L}.mlp.experts", f"{H}.mlp.experts", EXPERT_NAMES)
    shared = [(f"{L}.mlp.shared.mlp.{a}", f"{H}.mlp.shared_expert.{b}") for a, b in EXPERT_NAMES.items()]
    rules += renamed(shared + [(f"{L}.mlp.shared.gate", f"{H}.mlp.shared_expert_gate")], ("weight",))
    return KeyMap(rules)
