"""Arguments several commands share, declared once so `generate`, `serve` and `eval` cannot drift."""

from __future__ import annotations

import argparse

import torch

from ..loading import DTYPES, check_dtype_runs


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="compute, weights and KV cache in this dtype (default: the checkpoint's own, so a bf16 "
        "folder stays bf16; a preset: float32). With --quantize: the activations' dtype",
    )


def dtype_of(args: argparse.Namespace) -> torch.dtype | None:
    """--dtype as a torch dtype (None: the checkpoint's own), checked to run on this machine
    before any weights are read."""
    dtype = None if args.dtype is None else DTYPES[args.dtype]
    check_dtype_runs(dtype, "--dtype")
    return dtype
