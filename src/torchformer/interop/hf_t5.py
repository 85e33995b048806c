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

from ..config import AttentionConfig, BlockConfig, ModelConfig, RelativeBias
from .hf_config import common_out, token_fields, token_ids, unsupported
from .keymap import KeyMap, renamed, rule

MODEL_TYPES = ("t5",)
# HF's T5 never reads a cross-attention relative bias (old checkpoints carry one).
IGNORED = (r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight",)
FEED_FORWARD = {"relu": "relu", "gelu": "gelu", "gated-gelu": "geglu_tanh", "gated-silu": "swiglu"}
HF_FEED_FORWARD = {ours: theirs for theirs, ours in FEED_FORWARD.items()}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    problems: list[str] = []
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD:
        problems.append(f"feed_forward_proj={proj!r}: supported are {sorted(FEED_FORWARD)}")
    if hf.get("is_decoder", False):
        problems.append("is_decoder=True (a decoder-only T5 stack) is not supported")
    unsupported("t5", problems)
    vocab, d, dropout = hf["vocab_size"], hf["d_model"], hf.get("dropout_rate", 0.0)
    tied = hf.get("tie_word_embeddings", True) is not False
    scaled = hf.get("scale_decoder_outputs", tied)
    ids = token_ids(hf, vocab)
    if ids["decoder_start_token_id"] is None:  # T5 starts decoding with its pad token
        ids["decoder_start_token_id"] = ids["pad_token_id"]
    return ModelConfig(
        arch="encoder_decoder",
        vocab_size=vocab,
        d_model=d,
        n_layers=hf["num_layers"],
        n_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        max_seq_len=hf.get("n_positions", 512),  # relative positions have no table; this is a length cap
        attention=AttentionConfig(
            n_heads=hf["num_heads"],
            head_dim=hf["d_kv"],
            scale=1.0,  # T5 does not divide scores by sqrt(d_kv)
            dropout=dropout,
        ),
        block=BlockConfig(
            norm="rmsnorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-6),
            norm_placement="pre",
            mlp=FEED_FORWARD[proj],
            d_ff=hf["d_ff"],
            dropout=dropout,
        ),
        positions=RelativeBias(
            num_buckets=hf.get("relative_attention_num_buckets", 32),
            max_distance=hf.get("relative_attention_max_distance", 128),
        ),
        tie_embeddings=tied,
        share_embeddings=True,
        head_scale=d**-0.5 if scaled else None,  # Mesh TensorFlow's tied-head rescaling
        dropout=dropout,
        **ids,
    )


def unfit(cfg: ModelConfig) -> list[str]:
    """Why ``cfg`` cannot be written as a T5 checkpoint (empty when it can)."""
    a, b = cfg.attention, cfg.block
    rules = [
        (cfg.arch == "encoder_decoder", f"arch={cfg.arch!r} (needs 'encoder_decoder')"),
        (b.norm == "rmsnorm" and b.norm_placement == "pre", "needs pre-norm RMSNorm"),
        (b.mlp in HF_FEED_FORWARD, f"block.mlp={b.mlp!r} (needs one of {sorted(HF_FEED_FORWARD)})"),
        (not (a.bias or a.o_bias or b.bias), "has no biases"),
        (isinstance(cfg.positions, RelativeBias), f"positions={cfg.positions!r} (needs RelativeBias)"),
        (a.scale == 1.0 and a.softcap is None and a.sliding_window is None, "needs attention.scale=1.0, no cap/window"),
        (cfg.n_kv_heads == a.n_heads, "has no GQA"),
        (cfg.share_embeddings and cfg.has_final_norm, "needs shared embeddings and final norms"),
        (cfg.head_scale in (None, cfg.d_model**-0.5), f"head_scale={cfg.head_scale!r} (None or d_model ** -0.5)"),
        (not (cfg.embed_scale or cfg.embed_norm or cfg.final_logits_bias), "no embed_scale/embed_norm/logits bias"),
    ]
    return [why for ok, why in rules if not ok]


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    a, b = cfg.attention, cfg.block
    out = common_out(cfg, dtype, "t5", "T5ForConditionalGeneration")
    out.update(
        d_model=cfg.d_model,
        d_kv=cfg.head_dim,
        d_ff=cfg.d_ff,
        num_layers=cfg.n_layers,
        num_decoder_layers=cfg.decoder_layers,
        num_heads=a.n_heads,
        relative_attention_num_buckets=cfg.positions.num_buckets,
        relative_attention_max_distance=cfg.positions.max_distance,
        dropout_rate=b.dropout,
        layer_norm_epsilon=b.norm_eps,
        feed_forward_proj=HF_FEED_FORWARD[b.mlp],
        n_positions=cfg.max_seq_len,
        is_encoder_decoder=True,
        scale_decoder_outputs=cfg.head_scale is not None,
        **token_fields(cfg, ("pad_token_id", "eos_token_id", "decoder_start_token_id")),
    )
    generation = {k: v for k, v in out.items() if k in ("pad_token_id", "eos_token_id", "decoder_start_token_id")}
    return out, generation


def aliases(cfg: ModelConfig) -> dict[str, str]:
    """Copies of the shared table a checkpoint may carry."""
    out = {f"{side}.embed_tokens.weight": "shared.weight" for side in ("encoder", "decoder")}
    return {**out, "lm_head.weight": "shared.weight"} if cfg.tie_embeddings else out


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    gated = cfg.block.mlp in ("geglu_tanh", "swiglu")
    mlp = [("mlp.gate", "wi_0"), ("mlp.up", "wi_1")] if gated else [("mlp.up", "wi")]
    mlp.append(("mlp.down", "wo"))
    rules = [
        rule("src_embed.tok.weight", "shared.weight"),
        rule("lm_head.weight", "lm_head.weight"),
        rule("encoder.score_bias.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        rule("decoder.score_bias.weight", "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
    ]
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
