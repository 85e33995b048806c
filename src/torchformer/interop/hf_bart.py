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

import dataclasses
from typing import Any

from ..configs import Learned, Sinusoidal
from .family import Family, Field, Rule
from .keymap import KeyMap, renamed, rule
from .layouts import activation, dropouts, shape
from .transforms import as_row, as_vector

ENC, DEC, SHARED = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "model.shared.weight"
PAIRS = (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim"))


def one_side(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    """torchformer's encoder and decoder share their widths and vocabulary."""
    for enc, dec in PAIRS:
        if hf[enc] != hf[dec]:
            problems.append(f"{enc}={hf[enc]} != {dec}={hf[dec]}: encoder and decoder must match")
    if hf.get("decoder_vocab_size", hf["vocab_size"]) != hf["vocab_size"]:
        problems.append(f"decoder_vocab_size={hf['decoder_vocab_size']} != vocab_size={hf['vocab_size']}")
    values["share_embeddings"] = values["tie_embeddings"]


def write_sides(cfg, out: dict[str, Any]) -> None:
    out.update({dec: out[enc] for enc, dec in PAIRS}, is_encoder_decoder=True)
    if cfg.eos_token_id is not None:
        out["forced_eos_token_id"] = cfg.eos_token_id


def marian_tables(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    """Marian may keep the head tied to the decoder's own table (share_encoder_decoder_embeddings off)."""
    values["share_embeddings"] = values["tie_embeddings"] and hf.get("share_encoder_decoder_embeddings", True)


def write_marian_tables(cfg, out: dict[str, Any]) -> None:
    out.update(share_encoder_decoder_embeddings=cfg.share_embeddings, decoder_vocab_size=cfg.vocab_size)


def bart_or_marian(cfg) -> list[str]:
    pos = cfg.positions
    bart = isinstance(pos, Learned) and pos.offset == 2 and cfg.embed_norm
    marian = isinstance(pos, Sinusoidal) and pos.layout == "split" and pos.base == 10000.0 and not cfg.embed_norm
    return (
        []
        if bart or marian
        else ["needs BART's Learned(offset=2) + embed_norm, or Marian's Sinusoidal(layout='split')"]
    )


def aliases(cfg) -> dict[str, str]:
    if cfg.share_embeddings and cfg.tie_embeddings:
        return {ENC: SHARED, DEC: SHARED, "lm_head.weight": SHARED}
    return {"lm_head.weight": DEC} if cfg.tie_embeddings else {}


def keymap(cfg, hf_names=None) -> KeyMap:
    if cfg.share_embeddings and cfg.tie_embeddings:
        rules = [rule("src_embed.tok.weight", SHARED)]
    elif cfg.share_embeddings:  # one table, untied head: transformers 5 can only hold two copies
        rules = [rule("src_embed.tok.weight", (ENC, DEC), lambda ts: ts[:1], lambda ts: [ts[0], ts[0].clone()])]
    else:
        rules = [rule("src_embed.tok.weight", ENC), rule("tgt_embed.tok.weight", DEC)]
    rules += [
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
        sub = [("attn_norm", "self_attn_layer_norm"), ("cross_norm", "encoder_attn_layer_norm"), ("mlp.up", "fc1"),
               ("mlp.down", "fc2"), ("mlp_norm", "final_layer_norm")]  # fmt: skip
        pairs += [(f"{L}.{a}", f"{H}.{b}") for a, b in sub]
    return KeyMap(rules + renamed(pairs))


BART = Family(
    model_type="bart",
    architecture="BartForConditionalGeneration",
    fields=(
        *shape("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim"),
        Field("decoder_layers", "n_decoder_layers"),
        Field("max_position_embeddings", "max_seq_len"),
        activation("activation_function"),
        Field("scale_embedding", "embed_scale", False),
        *dropouts("dropout"),
        Field("attention_dropout", "attention.dropout", 0.0),
        Field("tie_word_embeddings", "tie_embeddings", True),
    ),
    keys=keymap,
    rules=(Rule("one encoder-decoder width", one_side, write_sides, bart_or_marian),),
    fixed={
        "arch": "encoder_decoder",
        "attention.bias": True,
        "block.norm": "layernorm",
        "block.norm_eps": 1e-5,  # nn.LayerNorm's default, which both use
        "block.norm_placement": "post",
        "block.bias": True,
        "final_logits_bias": True,
        "positions": Learned(offset=2),
        "embed_norm": True,
    },
    only={"normalize_before": False, "add_final_layer_norm": False},  # mBART's pre-LN
    # Marian's sinusoids follow from the config (older transformers saved them anyway); an untied
    # model never reads model.shared.
    ignored=(r"model\.(encoder|decoder)\.embed_positions\.weight", r"model\.shared\.weight"),
    aliases=aliases,
    tokens=("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"),
    generation=("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_eos_token_id"),
)
MARIAN = dataclasses.replace(
    BART,
    model_type="marian",
    architecture="MarianMTModel",
    fixed={**BART.fixed, "positions": Sinusoidal(layout="split"), "embed_norm": False},
    rules=(*BART.rules, Rule("shared tables", marian_tables, write_marian_tables)),
)
FAMILIES = (BART, MARIAN)
