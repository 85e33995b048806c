"""Qwen3-MoE and Qwen2-MoE: the Llama layout with expert MLPs (``mlp.gate`` router, per-expert
``gate_proj/up_proj/down_proj`` of width moe_intermediate_size), softmax top-k renormalised only
with ``norm_topk_prob``. Qwen3-MoE adds per-head RMSNorm on q and k (q_norm, k_norm) and optional
attention biases on all four projections; Qwen2-MoE has q/k/v biases (qkv_bias, no o bias) and
one shared expert of width shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate x).
A layer is dense (an MLP of intermediate_size) when it is in mlp_only_layers or when
(i + 1) % decoder_sparse_step != 0: those become a "dense" layer kind (configs/layers.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .family import OMIT, Field, Rule, module_functions
from .keymap import KeyMap, renamed, rule
from .layouts import (
    DERIVED_HEAD_DIM,
    SWIGLU_NAMES,
    L,
    dense_layers,
    dense_rule,
    expert_count,
    expert_rules,
    llama_family,
    llama_rules,
    permuted,
    rope_rule,
)


def dense(hf: dict[str, Any]) -> list[bool]:
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    return [i in only or (i + 1) % step != 0 for i in range(hf["num_hidden_layers"])]


def write_dense(cfg, out: dict[str, Any]) -> None:
    out.update(decoder_sparse_step=1, mlp_only_layers=dense_layers(cfg))


def omit(value, cfg) -> object:
    return OMIT


def shared(ours: str, read, write) -> Field:
    """Qwen2-MoE's one shared expert, sigmoid-gated, of this width (none where it is 0 or absent)."""
    return Field("shared_expert_intermediate_size", ours, None, read=read, write=write)


def shared_expert(cfg) -> list[str]:
    # qwen2_moe always builds one; without it the config is qwen3_moe's or mixtral's
    return [] if cfg.moe is not None and cfg.moe.n_shared else ["qwen2_moe needs a shared expert"]


def keymap(cfg, hf_names=None) -> KeyMap:
    H = "model.layers.{i}"
    pairing = cfg.positions.pairing
    # one head's features: permuted like one head of q/k rows
    rules = llama_rules(cfg) + [permuted(f"{L}.attn.{n}.norm.weight", f"{H}.self_attn.{n}.weight", 1, pairing)
                                for n in ("q_norm", "k_norm")]  # fmt: skip
    rules.append(rule(f"{L}.mlp.router.weight", f"{H}.mlp.gate.weight"))
    rules += expert_rules(cfg.moe.n_experts, f"{L}.mlp.experts", f"{H}.mlp.experts", SWIGLU_NAMES)
    shared = [(f"{L}.mlp.shared.mlp.{a}", f"{H}.mlp.shared_expert.{b}") for a, b in SWIGLU_NAMES.items()]
    return KeyMap(rules + renamed(shared + [(f"{L}.mlp.shared.gate", f"{H}.mlp.shared_expert_gate")], ("weight",)))


QWEN3_MOE = llama_family(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    Field("use_sliding_window", "attention.sliding_window", False, read={False: None}),
    expert_count("num_experts"),
    Field("num_experts_per_tok", "moe.top_k", 2),
    Field("moe_intermediate_size", "moe.d_expert"),
    Field("norm_topk_prob", "moe.renormalize", False),
    Field("attention_bias", "attention.bias", False),
    Field("attention_bias", "attention.out_bias", False),
    head_dim=DERIVED_HEAD_DIM,
    keys=keymap,
    rules=(rope_rule(whole=False), dense_rule(dense, write_dense)),
    fixed={"attention.qk_norm": "head"},  # RMSNorm over each head's features before RoPE
)
QWEN2_MOE = dataclasses.replace(
    QWEN3_MOE,
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    fields=(
        *QWEN3_MOE.fields[:-2],
        Field("qkv_bias", "attention.bias", True),
        shared("moe.n_shared", lambda v, hf: int(bool(v)), omit),
        shared("moe.shared_gate", lambda v, hf: bool(v), omit),
        shared("moe.d_shared", lambda v, hf: v or None, None),
    ),
    rules=(*QWEN3_MOE.rules, Rule("shared expert", check=shared_expert)),
    fixed={**QWEN3_MOE.fixed, "attention.qk_norm": None, "attention.out_bias": False},
)
FAMILIES = (QWEN3_MOE, QWEN2_MOE)
config_from_hf, config_to_hf = module_functions(*FAMILIES)
