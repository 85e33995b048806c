"""Cost accounting from a config alone: parameters (exact), FLOPs, KV-cache bytes."""

from __future__ import annotations

import torch

from ..config import ModelConfig


def count_params(cfg: ModelConfig) -> int:
    """Exact parameter count (tied tensors once), by building the model on the meta device:
    no memory is allocated, so llama3-8b counts in milliseconds."""
    from ..models.build import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())
