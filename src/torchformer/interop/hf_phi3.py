"""Phi-3 (and Phi-4-mini): the Llama layout (pre-RMSNorm, RoPE, GQA, SwiGLU, no biases) with
fused projections: ``qkv_proj`` is [Q; K; V] along its rows (n_heads, then n_kv_heads, then
n_kv_heads heads of head_dim) and ``gate_up_proj`` is [gate; up]; the transforms split and fuse
them. RoPE may be longrope (the 128k checkpoints: short/long factor lists chosen by the current
length) and partial (Phi-4-mini partial_rotary_factor 0.75); hf_rope.py reads and writes it.
``sliding_window`` (Phi-3-mini-4k: 2047) applies to every layer.
"""

from __future__ import annotations

from typing import Any

from ..configs import LongRoPE, RoPE
from .family import Field, Rule
from .hf_rope import rope_to_hf
from .keymap import KeyMap, renamed, rule
from .layouts import SPARSE_HEAD_DIM, L, llama_family, rope_rule, trunk_ends
from .transforms import fuse_rows, split_rows


def phi3_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's early names for longrope ("su", "yarn"), and its top-level original length."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"
    if "original_max_position_embeddings" in hf:
        params.setdefault("original_max_position_embeddings", hf["original_max_position_embeddings"])
    return dict(hf, rope_parameters=params)


def longrope_only(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    if values["positions"].scaling is not None and not isinstance(values["positions"].scaling, LongRoPE):
        kind = phi3_rope(hf)["rope_parameters"].get("rope_type")
        problems.append(f"rope_parameters.rope_type={kind!r}: Phi-3 has 'default' or 'longrope'")


def write_rope(cfg, out: dict[str, Any]) -> None:
    rope = rope_to_hf(cfg)
    rope["rope_parameters"]["partial_rotary_factor"] = cfg.positions.fraction
    original = rope["rope_parameters"].get("original_max_position_embeddings", cfg.max_seq_len)
    out.update(rope, original_max_position_embeddings=original)
    out.setdefault("pad_token_id", None)  # Phi3Config defaults it to 32000, which a small vocabulary lacks


def keymap(cfg, hf_names=None) -> KeyMap:
    if isinstance(cfg.positions, RoPE) and cfg.positions.pairing != "half":
        raise ValueError("rope_pairing='interleaved' is not supported for phi3 (fused qkv_proj, half-split rotary)")
    H = "model.layers.{i}"
    e, f = cfg.head_dim, cfg.d_ff
    qkv = [cfg.attention.n_heads * e, cfg.n_kv_heads * e, cfg.n_kv_heads * e]
    rules = trunk_ends() + [
        rule(tuple(f"{L}.attn.{p}_proj.weight" for p in "qkv"), f"{H}.self_attn.qkv_proj.weight",
             lambda ts: split_rows(ts[0], qkv), lambda ts: [fuse_rows(ts)]),
        rule((f"{L}.mlp.gate.weight", f"{L}.mlp.up.weight"), f"{H}.mlp.gate_up_proj.weight",
             lambda ts: split_rows(ts[0], [f, f]), lambda ts: [fuse_rows(ts)]),
    ]  # fmt: skip
    pairs = [("attn.o_proj", "self_attn.o_proj"), ("attn_norm", "input_layernorm"),
             ("mlp_norm", "post_attention_layernorm"), ("mlp.down", "mlp.down_proj")]  # fmt: skip
    return KeyMap(rules + renamed([(f"{L}.{a}", f"{H}.{b}") for a, b in pairs], ("weight",)))


PHI3 = llama_family(
    "phi3",
    "Phi3ForCausalLM",
    Field("resid_pdrop", "block.dropout", 0.0),
    Field("embd_pdrop", "dropout", 0.0),
    Field("sliding_window", "attention.sliding_window", None),
    eps=1e-5,
    head_dim=SPARSE_HEAD_DIM,
    keys=keymap,
    rules=(rope_rule(whole=False, prepare=phi3_rope), Rule("longrope", longrope_only, write_rope)),
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.(inv_freq|long_inv_freq)",),
    pairings=("half",),
)
FAMILIES = (PHI3,)
