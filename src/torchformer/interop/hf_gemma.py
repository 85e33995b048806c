"""Gemma, Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's norms and scales.

All three: RMSNorm times (1 + weight) in fp32 ("rmsnorm_1p"), embeddings times sqrt(hidden_size)
rounded to the weights' dtype, gated tanh-GELU MLP, explicit head_dim, tied head.
- gemma2: four norms per layer (sandwich: post_attention_layernorm is on the attention output
  before the residual add), scores scaled by query_pre_attn_scalar ** -0.5, attention soft-cap
  (attn_logit_softcapping, 50) and final-logit soft-cap (final_logit_softcapping, 30), a sliding
  window on the layers layer_types marks (every other one by default).
- gemma3_text: as gemma2 plus per-head QK-norm, soft-caps off by default, 5 sliding : 1 full
  layers, and a RoPE per layer type (rope_parameters["sliding_attention"] base 10000,
  ["full_attention"] base 1e6, linear scaling on the larger models): two layer kinds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .family import Family, Field, Rule
from .hf_kinds import FULL, SLIDING, layer_types, ropes_by_type, windows_to_hf
from .hf_rope import rope_from_hf, rope_to_hf
from .keymap import KeyMap
from .layouts import LLAMA_NORMS, layers_rule, llama_family, llama_rules, needs_rope, one_window, rope_rule

# transformers' ACT2FN names -> the gated MLP; "gelu" is Gemma 1's legacy spelling of the tanh form
MLPS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu"}
HF_MLPS = {"geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu"}
SANDWICH = (
    ("attn_norm", "input_layernorm"),
    ("attn_out_norm", "post_attention_layernorm"),
    ("mlp_norm", "pre_feedforward_layernorm"),
    ("mlp_out_norm", "post_feedforward_layernorm"),
)


def keymap(cfg, hf_names=None) -> KeyMap:
    qk = ()
    if cfg.attention.qk_norm == "head":
        if cfg.positions.pairing != "half":
            raise ValueError("rope_pairing='interleaved' is not supported with QK-norm (its weights would permute)")
        qk = (("attn.q_norm.norm", "self_attn.q_norm"), ("attn.k_norm.norm", "self_attn.k_norm"))
    return KeyMap(llama_rules(cfg, LLAMA_NORMS if cfg.block.norm_placement == "pre" else SANDWICH, qk))


def scale(scalar: float | None, hf: dict[str, Any]) -> float | None:
    """Gemma 2/3 scale scores by query_pre_attn_scalar ** -0.5 (None: head_dim's, the default)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return None if scalar is None or scalar == head_dim else scalar**-0.5


def scalar(value: float | None, cfg) -> float:
    s = cfg.head_dim if value is None else value**-2
    return round(s) if abs(s - round(s)) < 1e-6 else s


def layers(every: int) -> Any:
    """Sliding windows on the layer_types marked so (default: all but every ``every``-th)."""

    def read(hf: dict[str, Any], rope, problems: list[str]) -> tuple[list, list]:
        n = hf["num_hidden_layers"]
        default = [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]
        types = layer_types(hf, n, default, problems)
        ropes = [rope.get(t) for t in types] if isinstance(rope, dict) else [rope] * n
        return [hf.get("sliding_window", 4096) if t == SLIDING else None for t in types], ropes

    return read


def write_layers(cfg, out: dict[str, Any]) -> None:
    types, window = windows_to_hf(cfg, [])
    out.update(sliding_window=window or 4096, layer_types=types)


def read_type_ropes(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    """Gemma 3: a RoPE per layer type (positions: the full-attention one)."""
    by_type = {}
    for t, theta in ((FULL, 1_000_000.0), (SLIDING, 10_000.0)):  # transformers' Gemma 3 defaults
        params = dict((hf.get("rope_parameters") or {}).get(t) or {"rope_type": "default"})
        params.setdefault("rope_theta", hf.get("rope_theta" if t == FULL else "rope_local_base_freq", theta))
        by_type[t], values["max_seq_len"] = rope_from_hf({**hf, "rope_parameters": params}, problems)
    values["positions"] = by_type


def write_type_ropes(cfg, out: dict[str, Any]) -> None:
    ropes = ropes_by_type(cfg, [])
    out.update(rope_to_hf(cfg))
    out["rope_parameters"] = {t: rope_to_hf(cfg.replace(positions=r))["rope_parameters"] for t, r in ropes.items()}


def type_ropes_check(cfg) -> list[str]:
    problems = needs_rope(cfg)
    if not problems:
        ropes_by_type(cfg, problems)
    return problems


GEMMA = llama_family(
    "gemma",
    "GemmaForCausalLM",
    Field("attention_bias", "attention.bias", False),
    Field("attention_dropout", "attention.dropout", 0.0, empty=True),
    tied_default=True,
    mlp=Field("hidden_act", "block.mlp", "gelu_pytorch_tanh", read={**MLPS, "gelu": "geglu_tanh"}, write=HF_MLPS),
    keys=keymap,
    rules=(rope_rule(whole=False),),
    fixed={"block.norm": "rmsnorm_1p", "embed_scale": True, "embed_scale_in_dtype": True},
    only={"use_bidirectional_attention": False},  # only causal Gemma
)


def sandwich_gemma(model_type: str, architecture: str, caps: tuple, rope: Rule, every: int, **fixed) -> Family:
    """Gemma 2 and 3: sandwich norms, query_pre_attn_scalar, soft-caps (transformers' defaults
    differ), sliding windows on all but every ``every``-th layer."""
    return dataclasses.replace(
        GEMMA,
        model_type=model_type,
        architecture=architecture,
        fields=(
            *GEMMA.fields[:-3],
            Field("hidden_activation", "block.mlp", "gelu_pytorch_tanh", read=MLPS, write=HF_MLPS),
            *GEMMA.fields[-2:],
            Field("query_pre_attn_scalar", "attention.scale", None, read=scale, write=scalar),
            Field("attn_logit_softcapping", "attention.softcap", caps[0]),
            Field("final_logit_softcapping", "final_softcap", caps[1]),
        ),
        rules=(rope, Rule("one window", check=one_window), layers_rule(layers(every), write_layers)),
        fixed={**GEMMA.fixed, "block.norm_placement": "sandwich", **fixed},
    )


GEMMA2 = sandwich_gemma("gemma2", "Gemma2ForCausalLM", (50.0, 30.0), rope_rule(whole=False), 2)
TYPE_ROPES = Rule("a RoPE per layer type", read_type_ropes, write_type_ropes, type_ropes_check)
GEMMA3_TEXT = sandwich_gemma(
    "gemma3_text", "Gemma3ForCausalLM", (None, None), TYPE_ROPES, 6, **{"attention.qk_norm": "head"}
)
FAMILIES = (GEMMA, GEMMA2, GEMMA3_TEXT)
