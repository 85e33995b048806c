"""RoBERTa and XLM-RoBERTa: BERT's layout (hf_bert.py) with positions that start after the pad id.

fairseq numbers real tokens from padding_idx + 1 (the pad id, 1, owns row 1 of the table and
rows 0..1 are never used by real tokens), so the table has max_position_embeddings =
max_seq_len + padding_idx + 1 rows: ``Learned(offset=padding_idx + 1)``. HF derives position ids
by counting non-pad tokens, which is ``encoder_positions="counted"`` (the count of real tokens
before each one): left-padded rows get the positions they have alone. One token type (type_vocab_size 1); task heads
(``lm_head.*``, the pooler) are dropped on load, deliberately and by name.
"""

from __future__ import annotations

from typing import Any

from ..config import Learned, ModelConfig
from . import hf_bert
from .keymap import KeyMap

MODEL_TYPES = ("roberta",)  # hf_xlm_roberta.py reuses this module under its own model_type
ARCHITECTURES = {"roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}
IGNORED = (
    r"(roberta\.)?embeddings\.(position_ids|token_type_ids)",
    r"(roberta\.)?pooler\..*",
    r"lm_head\..*",
)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    pad = hf.get("pad_token_id", 1)
    if not isinstance(pad, int) or pad < 0:
        hf_bert.unsupported(hf["model_type"], [f"pad_token_id={pad!r}: positions start after it, so it must be set"])
    cfg = hf_bert.config_from_hf(hf)
    return cfg.replace(
        positions=Learned(offset=pad + 1),
        max_seq_len=hf.get("max_position_embeddings", 514) - pad - 1,
        encoder_positions="counted",
    )


def unfit(cfg: ModelConfig) -> list[str]:
    """BERT's rules, with positions offset by pad_token_id + 1 and counted instead of by column."""
    pos, pad = cfg.positions, cfg.pad_token_id
    rules = [
        (isinstance(pos, Learned) and pad is not None and pos.offset == pad + 1, "needs Learned(offset=pad_id + 1)"),
        (cfg.encoder_positions == "counted", "needs encoder_positions='counted'"),
    ]
    as_bert = cfg.replace(positions=Learned(), encoder_positions="columns") if isinstance(pos, Learned) else cfg
    return [why for ok, why in rules if not ok] + hf_bert.unfit(as_bert)


def config_to_hf(cfg: ModelConfig, dtype: str, model_type: str = "roberta") -> tuple[dict[str, Any], None]:
    out, _ = hf_bert.config_to_hf(cfg, dtype)
    offset = cfg.positions.offset
    out.update(
        architectures=[ARCHITECTURES[model_type]],
        model_type=model_type,
        max_position_embeddings=cfg.max_seq_len + offset,
        pad_token_id=offset - 1,
    )
    return out, None


def aliases(cfg: ModelConfig) -> dict[str, str]:
    return {}


def keymap(cfg: ModelConfig, hf_names: list[str] | None = None) -> KeyMap:
    return hf_bert.bert_keymap(hf_bert.body_prefix("roberta.", hf_names))
