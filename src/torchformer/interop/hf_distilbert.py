"""DistilBERT: BERT's post-LN encoder under its own names, without token types and without a
configurable eps (every LayerNorm is 1e-12). ``sinusoidal_pos_embds`` only changes how the
position table is initialised (HF saves it like a learned one), so both load as Learned().
Checkpoints are DistilBertModel (``embeddings.``) or a task model (``distilbert.``); the MLM
head (``vocab_transform``, ``vocab_layer_norm``, ``vocab_projector``) is dropped on load.
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, BlockConfig, Learned, ModelConfig
from .hf_bert import body_prefix
from .hf_config import HF_ACTIVATIONS, activation, biased_layernorm_rules, common_out, token_ids, unsupported
from .keymap import KeyMap, renamed, rule

MODEL_TYPES = ("distilbert",)
IGNORED = (r"(distilbert\.)?embeddings\.position_ids", r"vocab_(transform|layer_norm|projector)\..*")
EPS = 1e-12  # hard-coded in transformers' DistilBERT


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    problems: list[str] = []
    mlp = activation(hf, "activation", problems)
    unsupported("distilbert", problems)
    vocab, dropout = hf["vocab_size"], hf.get("dropout", 0.0)
    return ModelConfig(
        arch="encoder",
        vocab_size=vocab,
        d_model=hf["dim"],
        n_layers=hf["n_layers"],
        max_seq_len=hf.get("max_position_embeddings", 512),
        attention=AttentionConfig(n_heads=hf["n_heads"], bias=True, dropout=hf.get("attention_dropout", 0.0)),
        block=BlockConfig(
            norm="layernorm",
            norm_eps=EPS,
            norm_placement="post",
            mlp=mlp,
            d_ff=hf["hidden_dim"],
            bias=True,
            dropout=dropout,
        ),
        positions=Learned(),
        embed_norm=True,
        dropout=dropout,
        **token_ids(hf, vocab),
    )


def unfit(cfg: ModelConfig) -> list[str]:
    rules = [
        (cfg.arch == "encoder", f"arch={cfg.arch!r} (needs 'encoder')"),
        (isinstance(cfg.positions, Learned) and cfg.positions.offset == 0, "needs Learned() positions"),
        (cfg.embed_norm and not (cfg.embed_scale or cfg.has_final_norm), "needs embed_norm, no scale, no final norm"),
        (cfg.n_token_types == 0, f"n_token_types={cfg.n_token_types} (DistilBERT has none)"),
        (cfg.encoder_positions == "columns", "needs encoder_positions='columns' (DistilBERT numbers by column)"),
        (cfg.block.norm_eps == EPS, f"block.norm_eps={cfg.block.norm_eps} (DistilBERT fixes {EPS})"),
    ]
    rules += biased_layernorm_rules(cfg, "post")
    return [why for ok, why in rules if not ok]


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    out = common_out(cfg, dtype, "distilbert", "DistilBertModel")
    out.update(
        dim=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.attention.n_heads,
        hidden_dim=cfg.d_ff,
        activation=HF_ACTIVATIONS[cfg.block.mlp],
        max_position_embeddings=cfg.max_seq_len,
        dropout=cfg.block.dropout,
        attention_dropout=cfg.attention.dropout,
        sinusoidal_pos_embds=False,
    )
    return out, None


def aliases(cfg: ModelConfig) -> dict[str, str]:
    return {}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    p = body_prefix("distilbert.", hf_names)
    L, H = "stack.blocks.{i}", f"{p}transformer.layer.{{i}}"
    rules = [
        rule("embed.tok.weight", f"{p}embeddings.word_embeddings.weight"),
        rule("embed.absolute.weight", f"{p}embeddings.position_embeddings.weight"),
    ]
    pairs = [
        ("embed.norm", f"{p}embeddings.LayerNorm"),
        (f"{L}.attn.q_proj", f"{H}.attention.q_lin"),
        (f"{L}.attn.k_proj", f"{H}.attention.k_lin"),
        (f"{L}.attn.v_proj", f"{H}.attention.v_lin"),
        (f"{L}.attn.o_proj", f"{H}.attention.out_lin"),
        (f"{L}.attn_norm", f"{H}.sa_layer_norm"),
        (f"{L}.mlp.up", f"{H}.ffn.lin1"),
        (f"{L}.mlp.down", f"{H}.ffn.lin2"),
        (f"{L}.mlp_norm", f"{H}.output_layer_norm"),
    ]
    return KeyMap(rules + renamed(pairs))
