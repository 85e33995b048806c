"""Mixtral: the Mistral layout (pre-RMSNorm, RoPE, GQA, optional sliding window) with every MLP
an expert MLP: a bias-free router ``block_sparse_moe.gate`` and ``num_local_experts`` SwiGLU
experts ``w1`` (gate), ``w3`` (up), ``w2`` (down), softmax then top-k then renormalised (Jiang
2024, eq. 1-2; transformers' MixtralTopKRouter). On disk each expert has its own tensors;
torchformer holds them batched (layouts.expert_rules stacks and splits them).
"""

from __future__ import annotations

from . import layouts
from .family import Field, Rule
from .keymap import KeyMap, rule
from .layouts import DERIVED_HEAD_DIM, L, expert_count, expert_rules, llama_family, llama_rules, needs_moe, rope_rule


def keymap(cfg, hf_names=None) -> KeyMap:
    moe = "model.layers.{i}.block_sparse_moe"
    names = {"gate": "w1", "up": "w3", "down": "w2"}
    rules = llama_rules(cfg, mlp=False) + [rule(f"{L}.mlp.router.weight", f"{moe}.gate.weight")]
    return KeyMap(rules + expert_rules(cfg.moe.n_experts, f"{L}.mlp.experts", f"{moe}.experts", names))


MIXTRAL = llama_family(
    "mixtral",
    "MixtralForCausalLM",
    Field("sliding_window", "attention.sliding_window", None),
    expert_count("num_local_experts"),
    Field("num_experts_per_tok", "moe.top_k", 2),
    eps=1e-5,
    head_dim=DERIVED_HEAD_DIM,
    keys=keymap,
    rules=(Rule("experts", check=needs_moe), rope_rule(whole=False)),
    fixed={"moe.router": "softmax", "moe.renormalize": True},
)
FAMILIES = (MIXTRAL,)
stack_experts, unstack_experts = layouts.stack_experts, layouts.unstack_experts  # older code imports them here
