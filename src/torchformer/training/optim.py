"""AdamW with weight decay on matrices only (Loshchilov & Hutter 2019; GPT-2/nanoGPT practice):
embeddings and projection matrices decay; biases and norm gains (1-D tensors) do not."""

from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():  # .parameters() yields a tied tensor once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(
    model: nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, device_type: str
) -> torch.optim.AdamW:
    # The fused kernel updates every tensor in one pass: on CPU it is ~6x faster than the default
    # for-loop step (2 ms against 13 ms for the reverse recipe's 85 tensors), and HF's Trainer
    # defaults to it too. Other devices keep torch's default choice.
    fused = device_type in FUSED_DEVICES
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


FUSED_DEVICES = ("cpu", "cuda", "mps")
