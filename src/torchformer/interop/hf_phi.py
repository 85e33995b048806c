"""Phi-1, Phi-1.5 and Phi-2 (transformers' phi): one LayerNorm feeding attention and the MLP in
parallel, x + attn(ln x) + mlp(ln x) ("parallel_shared", as GPT-J), biases on every projection,
a gelu-tanh MLP (fc1, fc2), partial rotary on the first half of each head (partial_rotary_factor,
0.5 when absent) in the half-split layout, a final LayerNorm and a head with a bias.
"""

from __future__ import annotations

from typing import Any

from ..configs import RoPE
from .family import Family, Field, Rule
from .keymap import KeyMap, renamed
from .layouts import D_FF, SHAPE, SPARSE_HEAD_DIM, L, activation, heads, rope_rule, tied


def phi_rope(hf: dict[str, Any]) -> dict[str, Any]:
    params = dict(hf.get("rope_parameters") or {})
    params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))  # PhiConfig's default
    return dict(hf, rope_parameters=params)


def write_fraction(cfg, out: dict[str, Any]) -> None:
    out["rope_parameters"]["partial_rotary_factor"] = cfg.positions.fraction  # absent would read as 0.5


def keymap(cfg, hf_names=None) -> KeyMap:
    if isinstance(cfg.positions, RoPE) and cfg.positions.pairing != "half":
        raise ValueError("rope_pairing='interleaved' is not supported for phi (partial half-split rotary)")
    H = "model.layers.{i}"
    sub = [(f"attn.{p}_proj", f"self_attn.{p}_proj") for p in "qkv"]
    sub += [
        ("attn.o_proj", "self_attn.dense"),
        ("attn_norm", "input_layernorm"),
        ("mlp.up", "mlp.fc1"),
        ("mlp.down", "mlp.fc2"),
    ]
    ends = [("embed.tok", "model.embed_tokens"), ("stack.final_norm", "model.final_layernorm"), ("lm_head", "lm_head")]
    return KeyMap(renamed(ends + [(f"{L}.{ours}", f"{H}.{theirs}") for ours, theirs in sub]))


PHI = Family(
    model_type="phi",
    architecture="PhiForCausalLM",
    fields=(
        *SHAPE,
        Field("num_key_value_heads", "attention.n_kv_heads", heads, empty=True),
        SPARSE_HEAD_DIM,
        D_FF,
        activation("hidden_act"),
        Field("layer_norm_eps", "block.norm_eps", 1e-5),
        Field("attention_dropout", "attention.dropout", 0.0, empty=True),
        Field("resid_pdrop", "block.dropout", 0.0),
        Field("embd_pdrop", "dropout", 0.0),
        Field("tie_word_embeddings", "tie_embeddings", False),
    ),
    keys=keymap,
    rules=(rope_rule(whole=False, prepare=phi_rope), Rule("partial rotary", write=write_fraction)),
    fixed={
        "arch": "decoder",
        "attention.bias": True,
        "block.norm": "layernorm",
        "block.norm_placement": "parallel_shared",
        "block.bias": True,
        "final_logits_bias": True,  # lm_head has a bias
    },
    only={"qk_layernorm": False},
    aliases=tied("model.embed_tokens.weight"),
)
FAMILIES = (PHI,)
