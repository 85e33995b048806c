"""RoBERTa and XLM-RoBERTa: BERT's layout (layouts.py) with positions that start after the pad id.

fairseq numbers real tokens from padding_idx + 1 (the pad id, 1, owns row 1 of the table and
rows 0..1 are never used by real tokens), so the table has max_position_embeddings =
max_seq_len + padding_idx + 1 rows: ``Learned(offset=padding_idx + 1)``. HF derives position ids
by counting non-pad tokens, which is ``encoder_positions="counted"`` (the count of real tokens
before each one): left-padded rows get the positions they have alone. Task heads (``lm_head.*``,
the pooler) are dropped on load, deliberately and by name. XLM-R is the same under its own
model_type, so an export says ``xlm-roberta`` and loads as XLMRobertaModel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..configs import Learned
from .family import Family, Rule
from .keymap import KeyMap
from .layouts import BERT_FIELDS, BERT_ONLY, POST_LN_ENCODER, bert_rules, body_prefix


def read_positions(hf: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    pad = hf.get("pad_token_id", 1)
    if not isinstance(pad, int) or pad < 0:
        problems.append(f"pad_token_id={pad!r}: positions start after it, so it must be set")
        return
    values.update(positions=Learned(offset=pad + 1), max_seq_len=hf.get("max_position_embeddings", 514) - pad - 1)


def write_positions(cfg, out: dict[str, Any]) -> None:
    out.update(max_position_embeddings=cfg.max_seq_len + cfg.positions.offset, pad_token_id=cfg.positions.offset - 1)


def after_pad(cfg) -> list[str]:
    pos, pad = cfg.positions, cfg.pad_token_id
    ok = isinstance(pos, Learned) and pad is not None and pos.offset == pad + 1
    return [] if ok else ["needs Learned(offset=pad_id + 1)"]


ROBERTA = Family(
    model_type="roberta",
    architecture="RobertaModel",
    fields=BERT_FIELDS,
    keys=lambda cfg, names: KeyMap(bert_rules(body_prefix("roberta.", names))),
    rules=(Rule("positions after the pad id", read_positions, write_positions, after_pad),),
    fixed={**POST_LN_ENCODER, "encoder_positions": "counted"},
    written={"position_embedding_type": "absolute"},
    only=BERT_ONLY,
    ignored=(r"(roberta\.)?embeddings\.(position_ids|token_type_ids)", r"(roberta\.)?pooler\..*", r"lm_head\..*"),
    generation=None,
)
XLM_ROBERTA = dataclasses.replace(ROBERTA, model_type="xlm-roberta", architecture="XLMRobertaModel")
FAMILIES = (ROBERTA, XLM_ROBERTA)
