"""`torchformer verify`: the correctness checks on any model; exit code 1 when one fails."""

from __future__ import annotations

import argparse

import torch

from .. import presets

MAX_PARAMS = 50_000_000  # larger presets are verified as a scaled-down model of the same variant


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help=f"a checkpoint folder, a Hugging Face folder or a preset ({', '.join(presets.names())})"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the probes (and of a preset's random weights)")
    p.add_argument("--seq-len", type=int, default=16, help="length of the probe sequences (default 16)")
    p.add_argument(
        "--max-params",
        type=float,
        default=MAX_PARAMS,
        help=f"presets above this many parameters are verified scaled down (default {MAX_PARAMS:,})",
    )
    p.add_argument(
        "--full-length",
        action="store_true",
        help="run the fp16/bf16 forward at max_seq_len even on CPU (slow: bf16 matmuls ~1 GFLOP/s)",
    )


def model_for(spec: str, seed: int, max_params: float):
    """(model, note, untrained): large presets become a scaled-down model of the same variant."""
    from ..analysis.accounting import count_params
    from ..loading import load_any, model_kind
    from ..models.build import build_model
    from ..verify import shrink_config

    if model_kind(spec) != "preset":
        return load_any(spec, seed=seed), "", None
    cfg = presets.get(spec)
    n = count_params(cfg)
    if n <= max_params:
        return load_any(spec, seed=seed), f"{spec}: {n:,} parameters, random weights", True
    small = shrink_config(cfg)
    torch.manual_seed(seed)
    note = (
        f"{spec} has {n:,} parameters: verifying a scaled-down model of the same variant "
        f"({cfg.arch}, {cfg.block.norm}/{cfg.block.norm_placement}, {type(cfg.positions).__name__}, "
        f"{cfg.block.mlp}, heads {small.attention.n_heads}:{small.n_kv_heads}, {cfg.attention.backend}; "
        f"d_model {small.d_model}, {small.n_layers} layers, vocab {small.vocab_size}, "
        f"max_seq_len {small.max_seq_len}), random weights"
    )
    return build_model(small).eval(), note, True


def run(args: argparse.Namespace) -> int:
    """Run the correctness checks on MODEL and print check, value, threshold, status, message.

    causality (exact), cached == uncached, math == sdpa, padding invariance, relative positions
    (RoPE/ALiBi/relative bias), masked keys get zero weight, 1/sqrt(d_k) score scale, softmax
    saturation (warning), fp16/bf16 attention headroom and forward, initial loss ~ ln(V) for
    untrained models. Presets larger than --max-params are checked as a scaled-down model of
    the same variant (said in the first line). Exit code 1 when any check fails.

    torchformer verify llama3-8b
    """
    from ..verify import verify
    from ..verify.numerics import CPU_FLOP_BUDGET

    if args.seq_len < 4:
        raise ValueError(f"--seq-len={args.seq_len}: must be >= 4")
    model, note, untrained = model_for(args.model, args.seed, args.max_params)
    budget = None if args.full_length else CPU_FLOP_BUDGET
    report = verify(model, untrained=untrained, seq_len=args.seq_len, seed=args.seed, flop_budget=budget)
    report.note = note
    print(report.table())
    return 0 if report.ok else 1
