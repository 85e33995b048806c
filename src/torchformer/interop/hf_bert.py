"""BERT: post-LN encoder, learned positions, token types, a LayerNorm on the embedding sum.

Checkpoints come as BertModel (keys start at ``embeddings.``, as in all-MiniLM-L6-v2) or inside a
task model (``bert.embeddings...``); both load. torchformer's Encoder returns hidden states, so
the task heads on top of them are dropped on load, deliberately and by name: the pooler
(``pooler.dense``, tanh of the first token, used by next-sentence and classification heads) and
the pre-training heads (``cls.*``). Other heads (``classifier.*``, ...) are unexpected tensors.
Export writes a BertModel folder without a pooler (transformers initialises one and says so).
"""

from __future__ import annotations

from typing import Any

from ..config import AttentionConfig, BlockConfig, Learned, ModelConfig
from .hf_config import HF_ACTIVATIONS, activation, biased_layernorm_rules, common_out, token_ids, unsupported
from .keymap import KeyMap, renamed, rule

MODEL_TYPES = ("bert",)
IGNORED = (r"(bert\.)?embeddings\.position_ids", r"(bert\.)?pooler\..*", r"cls\..*")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    problems: list[str] = []
    mlp = activation(hf, "hidden_act", problems)
    if hf.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type={hf['position_embedding_type']!r}: only 'absolute'")
    if hf.get("is_decoder", False) or hf.get("add_cross_attention", False):
        problems.append("is_decoder/add_cross_attention: only the bidirectional encoder is supported")
    unsupported(hf.get("model_type", "bert"), problems)  # also RoBERTa's and XLM-R's reader
    vocab, hidden_dropout = hf["vocab_size"], hf.get("hidden_dropout_prob", 0.0)
    return ModelConfig(
        arch="encoder",
        vocab_size=vocab,
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        max_seq_len=hf.get("max_position_embeddings", 512),
        attention=AttentionConfig(
            n_heads=hf["num_attention_heads"], bias=True, dropout=hf.get("attention_probs_dropout_prob", 0.0)
        ),
        block=BlockConfig(
            norm="layernorm",
            norm_eps=hf.get("layer_norm_eps", 1e-12),
            norm_placement="post",
            mlp=mlp,
            d_ff=hf["intermediate_size"],
            bias=True,
            dropout=hidden_dropout,
        ),
        positions=Learned(),
        n_token_types=hf.get("type_vocab_size", 2),
        embed_norm=True,
        dropout=hidden_dropout,
        **token_ids(hf, vocab),
    )


def unfit(cfg: ModelConfig) -> list[str]:
    rules = [
        (cfg.arch == "encoder", f"arch={cfg.arch!r} (needs 'encoder')"),
        (isinstance(cfg.positions, Learned) and cfg.positions.offset == 0, "needs Learned() positions"),
        (
            cfg.embed_norm and not cfg.embed_scale and not cfg.has_final_norm,
            "needs embed_norm, no scale, no final norm",
        ),
        (cfg.n_token_types >= 1, "needs n_token_types >= 1"),
        (cfg.encoder_positions == "columns", "needs encoder_positions='columns' (BERT numbers by column)"),
    ]
    rules += biased_layernorm_rules(cfg, "post")
    return [why for ok, why in rules if not ok]


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    out = common_out(cfg, dtype, "bert", "BertModel")
    out.update(
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.attention.n_heads,
        intermediate_size=cfg.d_ff,
        hidden_act=HF_ACTIVATIONS[cfg.block.mlp],
        max_position_embeddings=cfg.max_seq_len,
        type_vocab_size=cfg.n_token_types,
        layer_norm_eps=cfg.block.norm_eps,
        hidden_dropout_prob=cfg.block.dropout,
        attention_probs_dropout_prob=cfg.attention.dropout,
        position_embedding_type="absolute",
    )
    return out, None


def aliases(cfg: ModelConfig) -> dict[str, str]:
    return {}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    return bert_keymap(body_prefix("bert.", hf_names))


def body_prefix(prefix: str, hf_names: list[str] | None) -> str:
    """``prefix`` when the checkpoint is a task model (``bert.``, ``roberta.``, ...), else ""."""
    return prefix if hf_names is not None and f"{prefix}embeddings.word_embeddings.weight" in hf_names else ""


def bert_keymap(p: str) -> KeyMap:
    """BERT's layout under the body prefix ``p`` (RoBERTa and XLM-R use it as it is)."""
    L, H = "stack.blocks.{i}", f"{p}encoder.layer.{{i}}"
    rules = [
        rule("embed.tok.weight", f"{p}embeddings.word_embeddings.weight"),
        rule("embed.absolute.weight", f"{p}embeddings.position_embeddings.weight"),
        rule("embed.token_types.weight", f"{p}embeddings.token_type_embeddings.weight"),
    ]
    pairs = [
        ("embed.norm", f"{p}embeddings.LayerNorm"),
        (f"{L}.attn.q_proj", f"{H}.attention.self.query"),
        (f"{L}.attn.k_proj", f"{H}.attention.self.key"),
        (f"{L}.attn.v_proj", f"{H}.attention.self.value"),
        (f"{L}.attn.o_proj", f"{H}.attention.output.dense"),
        (f"{L}.attn_norm", f"{H}.attention.output.LayerNorm"),
        (f"{L}.mlp.up", f"{H}.intermediate.dense"),
        (f"{L}.mlp.down", f"{H}.output.dense"),
        (f"{L}.mlp_norm", f"{H}.output.LayerNorm"),
    ]
    return KeyMap(rules + renamed(pairs))
