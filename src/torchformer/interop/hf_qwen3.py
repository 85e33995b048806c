"""Qwen3, SmolLM3 and OLMo 2: the Llama layout (RMSNorm, RoPE, GQA, SwiGLU) with one twist each.

- qwen3: per-head RMSNorm on q and k before RoPE (q_norm/k_norm of head_dim entries), explicit
  head_dim, per-layer sliding windows through layer_types (use_sliding_window).
- smollm3: NoPE on the layers ``no_rope_layers`` marks 0 (every 4th by default): a layer kind with
  rope None; sliding windows only on NoPE layers (layer_types).
- olmo2: no norm before the sublayers; a norm on each sublayer's output before the residual add
  (post_attention_layernorm, post_feedforward_layernorm: placement "output"), and RMSNorm over
  the whole q and k width (q_norm of n_heads * head_dim entries).
"""

from __future__ import annotations

from typing import Any

from .family import Field, Rule
from .hf_kinds import FULL, SLIDING, layer_types, per_layer
from .keymap import KeyMap
from .layouts import (
    LLAMA_NORMS,
    layers_rule,
    llama_family,
    llama_rules,
    one_window,
    qwen_windows,
    rope_rule,
    sliding_windows,
    write_windows,
)

QK_NORMS = {  # attention.qk_norm -> the (ours, theirs) norm modules
    "head": (("attn.q_norm.norm", "self_attn.q_norm"), ("attn.k_norm.norm", "self_attn.k_norm")),
    "width": (("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")),
    None: (),
}
OUTPUT_NORMS = (("attn_out_norm", "post_attention_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm"))


def keymap(cfg, hf_names=None) -> KeyMap:
    if cfg.attention.qk_norm is not None and cfg.positions.pairing != "half":
        raise ValueError("rope_pairing='interleaved' is not supported with QK-norm (the norm weights would permute)")
    norms = OUTPUT_NORMS if cfg.block.norm_placement == "output" else LLAMA_NORMS
    return KeyMap(llama_rules(cfg, norms, QK_NORMS[cfg.attention.qk_norm]))


def smollm3_layers(hf: dict[str, Any], rope, problems: list[str]) -> tuple[list, list]:
    """NoPE where no_rope_layers says 0; windows (layer_types) only on those by default."""
    n, interval = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
    uses = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses) != n:
        problems.append(f"no_rope_layers={uses}: must have num_hidden_layers={n} entries")
        uses = [1] * n
    default = [SLIDING if hf.get("use_sliding_window") and not u else FULL for u in uses]
    types = layer_types(hf, n, default, problems)
    windows = sliding_windows({**hf, "use_sliding_window": hf.get("use_sliding_window", False)}, types)
    return windows, [rope if u else None for u in uses]


def write_smollm3(cfg, out: dict[str, Any]) -> None:
    write_windows(cfg, out, max_window_layers=False)
    out["no_rope_layers"] = [int(k.rope is not None) for k in per_layer(cfg)]


def nope(cfg) -> bool:
    return any(k.rope is None for k in per_layer(cfg))


def smollm3_check(cfg) -> list[str]:
    problems = [] if nope(cfg) else ["smollm3 needs NoPE layers (qwen3/llama otherwise)"]
    if any(k.sliding_window is not None and k.rope is not None for k in per_layer(cfg)):
        problems.append("smollm3 windows only NoPE layers")
    return problems + one_window(cfg)


BIAS = Field("attention_bias", "attention.bias", False)
QWEN3 = llama_family(
    "qwen3",
    "Qwen3ForCausalLM",
    BIAS,
    keys=keymap,
    rules=(
        rope_rule(),
        Rule("no NoPE", check=lambda cfg: ["qwen3 has no NoPE layers"] if nope(cfg) else []),
        layers_rule(qwen_windows, write_windows, one_window),
    ),
    fixed={"attention.qk_norm": "head", "block.bias": False},
)
SMOLLM3 = llama_family(
    "smollm3",
    "SmolLM3ForCausalLM",
    BIAS,
    Field("mlp_bias", "block.bias", False),
    tied_default=True,
    keys=keymap,
    rules=(rope_rule(), layers_rule(smollm3_layers, write_smollm3, smollm3_check)),
)
OLMO2 = llama_family(
    "olmo2",
    "Olmo2ForCausalLM",
    BIAS,
    eps=1e-5,
    keys=keymap,
    rules=(rope_rule(),),
    fixed={"block.norm_placement": "output", "attention.qk_norm": "width", "block.bias": False},
)
FAMILIES = (QWEN3, SMOLLM3, OLMO2)
