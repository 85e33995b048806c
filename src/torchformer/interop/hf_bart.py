"""BART and Marian: post-LN encoder-decoders with biases everywhere and ``final_logits_bias``.

They differ in positions and embedding details only: BART learns a table with an offset of 2 rows
and puts a LayerNorm on the embedding sum (``layernorm_embedding``); Marian adds fixed sinusoids
in the split layout (all sines, then all cosines; no weights) and scales embeddings by
sqrt(d_model).

Tables follow transformers 5: with tie_word_embeddings (the published checkpoints) encoder,
decoder and head all use ``model.shared`` (Marian: unless share_encoder_decoder_embeddings is
off, then the head ties to the decoder's table); with it off, nothing is tied, the encoder and
decoder read their own ``embed_tokens`` and ``model.shared`` is unused.
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, BlockConfig, Learned, ModelConfig, Sinusoidal
from .hf_config import (
    HF_ACTIVATIONS,
    activation,
    biased_layernorm_rules,
    common_out,
    token_fields,
    token_ids,
    unsupported,
)
from .keymap import KeyMap, renamed, rule
from .transforms import as_row, as_vector

MODEL_TYPES = ("bart", "marian")
ARCHITECTURES = {"bart": "BartForConditionalGeneration", "marian": "MarianMTModel"}
# Marian's sinusoids follow from the config (older transformers saved them anyway); an untied
# model never reads model.shared.
IGNORED = (r"model\.(encoder|decoder)\.embed_positions\.weight", r"model\.shared\.weight")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type, problems = hf["model_type"], []
    mlp = activation(hf, "activation_function", problems)
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf[enc] != hf[dec]:
            problems.append(f"{enc}={hf[enc]} != {dec}={hf[dec]}: encoder and decoder must match")
    if hf.get("normalize_before", False) or hf.get("add_final_layer_norm", False):
        problems.append("normalize_before/add_final_layer_norm (mBART's pre-LN): only post-LN is supported")
    tied = hf.get("tie_word_embeddings", True)
    shared = tied and (model_type == "bart" or hf.get("share_encoder_decoder_embeddings", True))
    if hf.get("decoder_vocab_size", hf["vocab_size"]) != hf["vocab_size"]:
        problems.append(f"decoder_vocab_size={hf['decoder_vocab_size']} != vocab_size={hf['vocab_size']}")
    unsupported(model_type, problems)
    vocab = hf["vocab_size"]
    return ModelConfig(
        arch="encoder_decoder",
        vocab_size=vocab,
        d_model=hf["d_model"],
        n_layers=hf["encoder_layers"],
        n_decoder_layers=hf["decoder_layers"],
        max_seq_len=hf["max_position_embeddings"],
        attention=AttentionConfig(
            n_heads=hf["encoder_attention_heads"], bias=True, dropout=hf.get("attention_dropout", 0.0)
        ),
        block=BlockConfig(
            norm="layernorm",
            norm_eps=1e-5,  # nn.LayerNorm's default, which both use
            norm_placement="post",
            mlp=mlp,
            d_ff=hf["encoder_ffn_dim"],
            bias=True,
            dropout=hf.get("dropout", 0.0),
        ),
        positions=Learned(offset=2) if model_type == "bart" else Sinusoidal(layout="split"),
        embed_scale=hf.get("scale_embedding", False),
        embed_norm=model_type == "bart",
        final_logits_bias=True,
        tie_embeddings=tied,
        share_embeddings=shared,
        dropout=hf.get("dropout", 0.0),
        **token_ids(hf, vocab),
    )


def model_type_for(cfg: ModelConfig) -> str:
    return "bart" if isinstance(cfg.positions, Learned) else "marian"


def unfit(cfg: ModelConfig) -> list[str]:
    b, pos = cfg.block, cfg.positions
    bart = isinstance(pos, Learned) and pos.offset == 2 and cfg.embed_norm
    marian = isinstance(pos, Sinusoidal) and pos.layout == "split" and pos.base == 10000.0 and not cfg.embed_norm
    rules = [
        (cfg.arch == "encoder_decoder", f"arch={cfg.arch!r} (needs 'encoder_decoder')"),
        (bart or marian, "needs BART's Learned(offset=2) + embed_norm, or Marian's Sinusoidal(layout='split')"),
        (b.norm_eps == 1e-5, f"block.norm_eps={b.norm_eps} (needs 1e-5)"),
        (cfg.final_logits_bias and not cfg.has_final_norm, "needs final_logits_bias and no final norm"),
        (not bart or cfg.share_embeddings or not cfg.tie_embeddings, "BART ties its head to a shared table"),
    ]
    rules += biased_layernorm_rules(cfg, "post")
    return [why for ok, why in rules if not ok]


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    model_type = model_type_for(cfg)
    out = common_out(cfg, dtype, model_type, ARCHITECTURES[model_type])
    out.update(
        d_model=cfg.d_model,
        encoder_layers=cfg.n_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.attention.n_heads,
        decoder_attention_heads=cfg.attention.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function=HF_ACTIVATIONS[cfg.block.mlp],
        max_position_embeddings=cfg.max_seq_len,
        scale_embedding=cfg.embed_scale,
        dropout=cfg.block.dropout,
        attention_dropout=cfg.attention.dropout,
        is_encoder_decoder=True,
    )
    out.update(token_fields(cfg, ("decoder_start_token_id",)))
    if cfg.eos_token_id is not None:
        out["forced_eos_token_id"] = cfg.eos_token_id
    if model_type == "marian":
        out.update(share_encoder_decoder_embeddings=cfg.share_embeddings, decoder_vocab_size=cfg.vocab_size)
    keep = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_eos_token_id")
    return out, {k: out[k] for k in keep if k in out}


ENC, DEC, SHARED = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "model.shared.weight"


def aliases(cfg: ModelConfig) -> dict[str, str]:
    if cfg.share_embeddings and cfg.tie_embeddings:
        return {ENC: SHARED, DEC: SHARED, "lm_head.weight": SHARED}
    return {"lm_head.weight": DEC} if cfg.tie_embeddings else {}


def _token_rules(cfg: ModelConfig) -> list:
    if cfg.share_embeddings and cfg.tie_embeddings:
        return [rule("src_embed.tok.weight", SHARED)]
    if cfg.share_embeddings:  # one table, untied head: transformers 5 can only hold two copies
        return [rule("src_embed.tok.weight", (ENC, DEC), lambda ts: ts[:1], lambda ts: [ts[0], ts[0].clone()])]
    return [rule("src_embed.tok.weight", ENC), rule("tgt_embed.tok.weight", DEC)]


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    rules = _token_rules(cfg) + [
        rule("lm_head.weight", "lm_head.weight"),
        rule("lm_head.bias", "final_logits_bias", lambda ts: [as_vector(ts[0])], lambda ts: [as_row(ts[0])]),
    ]
    pairs = []
    for ours, theirs in (("src_embed", "model.encoder"), ("tgt_embed", "model.decoder")):
        rules.append(rule(f"{ours}.absolute.weight", f"{theirs}.embed_positions.weight"))
        pairs.append((f"{ours}.norm", f"{theirs}.layernorm_embedding"))
    for ours, theirs in (("encoder", "model.encoder"), ("decoder", "model.decoder")):
        L, H = f"{ours}.blocks.{{i}}", f"{theirs}.layers.{{i}}"
        for attn, hf_attn in (("attn", "self_attn"), ("cross_attn", "encoder_attn")):
            pairs += [(f"{L}.{attn}.{p}_proj", f"{H}.{hf_attn}.{p}_proj") for p in "qkv"]
            pairs.append((f"{L}.{attn}.o_proj", f"{H}.{hf_attn}.out_proj"))
        pairs += [
            (f"{L}.attn_norm", f"{H}.self_attn_layer_norm"),
            (f"{L}.cross_norm", f"{H}.encoder_attn_layer_norm"),
            (f"{L}.mlp.up", f"{H}.fc1"),
            (f"{L}.mlp.down", f"{H}.fc2"),
            (f"{L}.mlp_norm", f"{H}.final_layer_norm"),
        ]
    return KeyMap(rules + renamed(pairs))
