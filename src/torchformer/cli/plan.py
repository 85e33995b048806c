"""`torchformer plan`: what a model costs before running it."""

from __future__ import annotations

import argparse

from .. import presets
from ..analysis.accounting import count_params


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"a preset name ({', '.join(presets.names())})")


def run(args: argparse.Namespace) -> int:
    """Print the parameter count of a model (a preset name)."""
    cfg = presets.get(args.model)
    print(f"{args.model}: {count_params(cfg):,} parameters ({cfg.arch}, {cfg.n_layers} layers, d_model {cfg.d_model})")
    return 0
