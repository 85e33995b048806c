"""`torchformer demo`: the main job on the embedded default (until training lands: plan + forward)."""

from __future__ import annotations

import argparse

import torch

from .. import presets
from ..analysis.accounting import count_params
from ..models.build import build_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", nargs="?", default="default", help="which demo")


def run(args: argparse.Namespace) -> int:
    """Print the size of a few presets and run a forward pass of llama-tiny."""
    for name in ("vanilla-base", "gpt2-small", "llama2-7b", "llama-tiny"):
        print(f"{name:14s} {count_params(presets.get(name)):>15,} parameters")
    torch.manual_seed(0)
    model = build_model(presets.get("llama-tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        logits = model(ids)
    print(f"llama-tiny forward: ids {tuple(ids.shape)} -> logits {tuple(logits.shape)}")
    return 0
