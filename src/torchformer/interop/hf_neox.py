"""GPT-NeoX (Pythia): pre-LN LayerNorm with biases, partial rotary, parallel residual, untied head.

Each layer computes x + attn(ln1 x) + mlp(ln2 x) (``use_parallel_residual``, the default; False is
the sequential pre-norm block). RoPE turns the first ``rotary_pct`` (transformers 5:
``rope_parameters.partial_rotary_factor``, default 0.25) of each head in the half-split layout.
``query_key_value`` fuses q, k and v head by head ([q_h; k_h; v_h] for every head h), which the
transforms split and fuse. The head is ``embed_out`` in published checkpoints; transformers 5
renames it to ``lm_head`` on load, and either name loads here.
"""

from __future__ import annotations

from typing import Any

from ..configs import RoPE
from .family import Family, Field, Rule
from .keymap import KeyMap, renamed, rule
from .layouts import D_FF, SHAPE, activation, dropouts, rope_rule, tied
from .transforms import fuse_head_interleaved, split_head_interleaved


def neox_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """4.x names: rotary_pct and rotary_emb_base; HF's default fraction for NeoX is 0.25, not 1."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    params.setdefault("rope_theta", hf.get("rotary_emb_base", 10000.0))
    return dict(hf, rope_parameters=params)


def write_rope(cfg, out: dict[str, Any]) -> None:
    out["rope_parameters"]["partial_rotary_factor"] = cfg.positions.fraction
    out.update(rotary_pct=cfg.positions.fraction, rotary_emb_base=cfg.positions.base)  # read by transformers 4.x


def keymap(cfg, hf_names=None) -> KeyMap:
    if isinstance(cfg.positions, RoPE) and cfg.positions.pairing != "half":
        raise ValueError("rope_pairing='interleaved' is not supported for gpt_neox (partial half-split rotary)")
    head = "lm_head.weight" if hf_names is not None and "lm_head.weight" in hf_names else "embed_out.weight"
    L, H, n = "stack.blocks.{i}", "gpt_neox.layers.{i}", cfg.attention.n_heads
    qkv = tuple(f"{L}.attn.{p}_proj" for p in "qkv")
    rules = [rule("embed.tok.weight", "gpt_neox.embed_in.weight"), rule("lm_head.weight", head)]
    rules += [
        rule(tuple(f"{name}.{s}" for name in qkv), f"{H}.attention.query_key_value.{s}",
             lambda ts: split_head_interleaved(ts[0], n), lambda ts: [fuse_head_interleaved(ts, n)])
        for s in ("weight", "bias")
    ]  # fmt: skip
    pairs = [("attn.o_proj", "attention.dense"), ("attn_norm", "input_layernorm"),
             ("mlp_norm", "post_attention_layernorm"), ("mlp.up", "mlp.dense_h_to_4h"),
             ("mlp.down", "mlp.dense_4h_to_h")]  # fmt: skip
    return KeyMap(
        rules
        + renamed([(f"{L}.{a}", f"{H}.{b}") for a, b in pairs] + [("stack.final_norm", "gpt_neox.final_layer_norm")])
    )


GPT_NEOX = Family(
    model_type="gpt_neox",
    architecture="GPTNeoXForCausalLM",
    fields=(
        *SHAPE,
        D_FF,
        activation("hidden_act"),
        Field("layer_norm_eps", "block.norm_eps", 1e-5),
        # x + attn(ln1 x) + mlp(ln2 x), or the sequential pre-norm block
        Field("use_parallel_residual", "block.norm_placement", True, read={True: "parallel", False: "pre"}),
        Field("attention_bias", "attention.bias", True),
        Field("attention_dropout", "attention.dropout", 0.0),
        *dropouts("hidden_dropout"),
        Field("tie_word_embeddings", "tie_embeddings", False),
    ),
    keys=keymap,
    rules=(rope_rule(whole=False, prepare=neox_rope), Rule("rotary_pct", write=write_rope)),
    fixed={"arch": "decoder", "block.norm": "layernorm", "block.bias": True},  # GPTNeoXMLP's linears have biases
    only={"add_cross_attention": False},
    # Causal-mask and rotary buffers older transformers saved; they follow from the config.
    ignored=(r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",),
    aliases=tied("gpt_neox.embed_in.weight", "embed_out.weight", "lm_head.weight"),
)
FAMILIES = (GPT_NEOX,)
