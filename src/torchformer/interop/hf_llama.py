"""Llama, Mistral and Qwen2: one layout (pre-RMSNorm, RoPE, GQA, SwiGLU) with three switches:
Llama's attention_bias/mlp_bias, Mistral's sliding window, Qwen2's q/k/v bias without an o bias.

RoPE base, scaling and max_position_embeddings: hf_rope.py; partial rotary is refused (HF Llama
rotates whole heads). Qwen2's ``use_sliding_window`` + ``max_window_layers`` (or ``layer_types``)
may window only some layers: those become layer kinds (hf_kinds.py).
"""

from __future__ import annotations

from typing import Any

from .family import Field, Rule, module_functions
from .layouts import layers_rule, llama_family, one_window, own_ropes, qwen_windows, rope_rule, write_windows

RULES = (rope_rule(), Rule("one RoPE", check=own_ropes))


def qwen2_windows(hf: dict[str, Any], rope, problems: list[str]) -> tuple[list, list]:
    if not hf.get("use_sliding_window", False):
        return [None] * hf["num_hidden_layers"], [rope] * hf["num_hidden_layers"]
    return qwen_windows(hf, rope, problems)


LLAMA = llama_family(
    "llama",
    "LlamaForCausalLM",
    Field("attention_bias", "attention.bias", False),
    Field("attention_bias", "attention.out_bias", False),
    Field("mlp_bias", "block.bias", False),
    rules=RULES,
)
NO_MLP_BIAS = {"block.bias": False}
MISTRAL = llama_family(
    "mistral",
    "MistralForCausalLM",
    Field("sliding_window", "attention.sliding_window", None),
    rules=RULES,
    fixed={"attention.bias": False, "attention.out_bias": False, **NO_MLP_BIAS},
)
QWEN2 = llama_family(
    "qwen2",
    "Qwen2ForCausalLM",
    rules=(*RULES, layers_rule(qwen2_windows, write_windows, one_window)),
    fixed={"attention.bias": True, "attention.out_bias": False, **NO_MLP_BIAS},
)
FAMILIES = (LLAMA, MISTRAL, QWEN2)
config_from_hf, config_to_hf = module_functions(*FAMILIES)
