"""XLM-RoBERTa: RoBERTa's layout and config (hf_roberta.py) under its own model_type, so an
export says ``xlm-roberta`` and loads as XLMRobertaModel."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import hf_roberta
from .hf_roberta import IGNORED, aliases, config_from_hf, keymap, unfit

MODEL_TYPES = ("xlm-roberta",)
__all__ = ["IGNORED", "MODEL_TYPES", "aliases", "config_from_hf", "config_to_hf", "keymap", "unfit"]


def config_to_hf(cfg: ModelConfig, dtype: str) -> tuple[dict[str, Any], None]:
    return hf_roberta.config_to_hf(cfg, dtype, "xlm-roberta")
