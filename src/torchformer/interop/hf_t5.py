"""T5 (v1.0: ReLU, tied, output scaled) and T5 v1.1 / Flan-T5 (gated GELU, untied, unscaled).

A pre-norm encoder-decoder with RMS-only LayerNorms (no mean, no bias, fp32 variance), no biases,
unscaled attention scores (scale 1: the 1/sqrt(d_kv) is folded into the initialisation) and a
learned bucketed relative bias that block 0 of each stack owns and every layer of that stack
reuses (our Stack computes it once per forward: ``score_bias``). ``feed_forward_proj`` "relu" is
wo(relu(wi x)); "gated-gelu" is wo(gelu_new(wi_0 x) * wi_1 x).

Tied heads: original T5 checkpoints say ``tie_word_embeddings`` and scale the decoder output by
d_model ** -0.5 before the head; v1.1 says False and does neither. transformers 5 always sets
tie_word_embeddings True and keeps the scaling in ``scale_decoder_outputs`` (it unties when the
checkpoint holds a different ``lm_head.weight``); both forms are read, and both written.
"""

from __future__ import annotations

from typing import Any

from ..configs import RelativeBias
from .family import Family, Field, Rule
from .keymap import KeyMap, renamed, rule
from .layouts import dropouts, shape

FEED_FORWARD = {"relu": "relu", "gelu": "gelu", "gated-gelu": "geglu_tanh", "gated-silu": "swiglu"}
TOKENS = ("pad_token_id", "eos_token_id", "decoder_start_token_id")


def read_head(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    """Mesh TensorFlow's tied-head rescaling; decoding starts with the pad token unless told."""
    scaled = hf.get("scale_decoder_outputs", values["tie_embeddings"])
    values["head_scale"] = hf["d_model"] ** -0.5 if scaled else None
    if values["decoder_start_token_id"] is None:
        values["decoder_start_token_id"] = values["pad_token_id"]
    values["positions"] = RelativeBias(
        num_buckets=hf.get("relative_attention_num_buckets", 32),
        max_distance=hf.get("relative_attention_max_distance", 128),
    )


def write_head(cfg, out: dict[str, Any]) -> None:
    out.update(is_encoder_decoder=True, scale_decoder_outputs=cfg.head_scale is not None)
    if isinstance(cfg.positions, RelativeBias):
        out.update(relative_attention_num_buckets=cfg.positions.num_buckets,
                   relative_attention_max_distance=cfg.positions.max_distance)  # fmt: skip


def aliases(cfg) -> dict[str, str]:
    """Copies of the shared table a checkpoint may carry."""
    out = {f"{side}.embed_tokens.weight": "shared.weight" for side in ("encoder", "decoder")}
    return {**out, "lm_head.weight": "shared.weight"} if cfg.tie_embeddings else out


def keymap(cfg, hf_names=None) -> KeyMap:
    gated = cfg.block.mlp in ("geglu_tanh", "swiglu")
    mlp = [("mlp.gate", "wi_0"), ("mlp.up", "wi_1")] if gated else [("mlp.up", "wi")]
    mlp.append(("mlp.down", "wo"))
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    rules = [rule("src_embed.tok.weight", "shared.weight"), rule("lm_head.weight", "lm_head.weight")]
    rules += [rule(f"{stack}.score_bias.weight", f"{stack}.{bias}") for stack in ("encoder", "decoder")]
    pairs = []
    for stack, sublayers in (("encoder", ("SelfAttention",)), ("decoder", ("SelfAttention", "EncDecAttention"))):
        L, H = f"{stack}.blocks.{{i}}", f"{stack}.block.{{i}}.layer"
        for j, (ours, norm, theirs) in enumerate(zip(("attn", "cross_attn"), ("attn_norm", "cross_norm"), sublayers)):
            pairs += [(f"{L}.{ours}.{p}_proj", f"{H}.{j}.{theirs}.{p}") for p in "qkvo"]
            pairs.append((f"{L}.{norm}", f"{H}.{j}.layer_norm"))
        ff = len(sublayers)  # the feed-forward sublayer's index: 1 in the encoder, 2 in the decoder
        pairs += [(f"{L}.{ours}", f"{H}.{ff}.DenseReluDense.{theirs}") for ours, theirs in mlp]
        pairs += [(f"{L}.mlp_norm", f"{H}.{ff}.layer_norm"), (f"{stack}.final_norm", f"{stack}.final_layer_norm")]
    return KeyMap(rules + renamed(pairs, ("weight",)))


T5 = Family(
    model_type="t5",
    architecture="T5ForConditionalGeneration",
    fields=(
        *shape("d_model", "num_layers", "num_heads", "d_ff"),
        Field("num_decoder_layers", "n_decoder_layers", lambda hf: hf["num_layers"], empty=True),
        Field("n_positions", "max_seq_len", 512),  # relative positions have no table; this is a length cap
        Field("d_kv", "attention.head_dim"),
        Field("layer_norm_epsilon", "block.norm_eps", 1e-6),
        Field("feed_forward_proj", "block.mlp", "relu", read=FEED_FORWARD),
        *dropouts("dropout_rate", "attention.dropout", "block.dropout", "dropout"),
        Field("tie_word_embeddings", "tie_embeddings", True, read=lambda v, hf: v is not False),
    ),
    keys=keymap,
    rules=(Rule("relative bias and head", read_head, write_head),),
    fixed={
        "arch": "encoder_decoder",
        "attention.scale": 1.0,
        "block.norm": "rmsnorm",
        "block.norm_placement": "pre",
        "share_embeddings": True,
    },  # fmt: skip
    only={"is_decoder": False},  # a decoder-only T5 stack
    # HF's T5 never reads a cross-attention relative bias (old checkpoints carry one).
    ignored=(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",),
    aliases=aliases,
    tokens=("bos_token_id", *TOKENS),
    generation=TOKENS,
)
FAMILIES = (T5,)
