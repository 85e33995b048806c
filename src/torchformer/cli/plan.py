"""`torchformer plan`: what a model costs before running it (from its config alone)."""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path

from .. import presets
from ..analysis.accounting import (
    PARTS,
    as_dtype,
    count_params,
    flops_per_token,
    kv_cache_bytes,
    matmul_peak_flops,
    mfu,
    param_breakdown,
    training_bytes,
    weight_bytes,
)
from ..analysis.moe_accounting import cache_numbers_per_token, expanded_cache_numbers
from ..configs import ModelConfig
from ..models.quantize import DEFAULT_GROUP_SIZE


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help=f"a checkpoint folder, a Hugging Face folder or a preset ({', '.join(presets.names())})"
    )
    p.add_argument("--seq-len", type=int, default=None, help="context length (default: the model's max_seq_len)")
    p.add_argument("--batch-size", type=int, default=1, help="batch size for KV cache and activations (default 1)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--tokens-per-second", type=float, default=None, help="measured training throughput, for MFU")
    p.add_argument(
        "--peak-tflops", default=None, help="hardware peak in TFLOP/s for MFU, or 'measure' (an fp32 CPU matmul timing)"
    )
    p.add_argument("--quantize", choices=["int8", "int4"], default=None, help="report weight bytes after tfm.quantize")
    p.add_argument("--group-size", type=int, default=None, help="with --quantize int4: inputs per scale (default 64)")


def config_of(spec: str) -> ModelConfig:
    """The config of a checkpoint, HF folder, .gguf file or preset, without loading any weights."""
    from ..loading import model_config

    return model_config(spec)


def peak_flops(text: str) -> float:
    """FLOP/s from --peak-tflops: a number of TFLOP/s, or 'measure'."""
    if text == "measure":
        return matmul_peak_flops()
    try:
        value = float(text)
    except ValueError as err:
        raise ValueError(f"--peak-tflops={text!r}: must be a number of TFLOP/s or 'measure'") from err
    if value <= 0:
        raise ValueError(f"--peak-tflops={text!r}: must be > 0")
    return value * 1e12


def human(n: float, unit: str = "B") -> str:
    """Bytes in binary units (KiB, MiB, GiB); other units in decimal steps (k, M, G, T)."""
    base, prefixes = (1024, ["", "Ki", "Mi", "Gi", "Ti"]) if unit == "B" else (1000, ["", "k", "M", "G", "T"])
    i = 0
    while abs(n) >= base and i < len(prefixes) - 1:
        n, i = n / base, i + 1
    return f"{n:.2f} {prefixes[i]}{unit}"


def lines_for(cfg: ModelConfig, name: str, seq_len: int, batch: int, dtype: str) -> list[str]:
    a = cfg.attention
    kv_note = f" ({cfg.n_kv_heads} KV)" if cfg.n_kv_heads != a.n_heads else ""
    out = [
        f"{name}: {cfg.arch}, {cfg.n_layers} layers"
        + (f" + {cfg.decoder_layers} decoder layers" if cfg.arch == "encoder_decoder" else "")
        + f", d_model {cfg.d_model}, {a.n_heads} heads{kv_note}, head_dim {cfg.head_dim}, d_ff {cfg.d_ff}, "
        f"vocab {cfg.vocab_size}, max_seq_len {cfg.max_seq_len}",
        f"seq_len {seq_len}, batch_size {batch}, dtype {dtype}",
        "",
        f"{'part':<12} {'parameters':>16} {'share':>7}",
    ]
    parts = param_breakdown(cfg)
    total = sum(parts.values())
    for part in PARTS:
        out.append(f"{part:<12} {parts[part]:>16,} {parts[part] / total:>7.1%}")
    out.append(f"{'total':<12} {total:>16,}")
    if cfg.moe is not None:  # what one token multiplies: top_k of the routed experts
        active = count_params(cfg, active=True)
        m = cfg.moe
        shared = f" + {m.n_shared} shared" if m.n_shared else ""
        out.append(f"{'active':<12} {active:>16,} {active / total:>7.1%}  per token ({m.top_k} of {m.n_experts} "
                   f"experts{shared}; FLOPs below use active parameters)")  # fmt: skip
    f = flops_per_token(cfg, seq_len)
    out += [
        "",
        f"FLOPs/token   forward {human(f.forward, 'FLOP')}   training {human(f.training, 'FLOP')}",
        "              (forward = 2 N_matmul + 4 L T H E; training = 3 x forward)",
    ]
    return out + memory_lines(cfg, seq_len, batch, dtype)


def memory_lines(cfg: ModelConfig, seq_len: int, batch: int, dtype: str) -> list[str]:
    out = []
    if cfg.arch != "encoder":
        kv = kv_cache_bytes(cfg, seq_len, batch, dtype)
        out.append(f"KV cache      {human(kv)} ({human(kv / (seq_len * batch))}/token)")
        if cfg.mla is not None:  # the latent + rotary key instead of every head's K and V
            ratio = Fraction(cache_numbers_per_token(cfg), expanded_cache_numbers(cfg))
            full = kv * ratio.denominator // ratio.numerator
            out.append(f"  vs per-head K/V {human(full)}: MLA keeps {ratio} of it "
                       f"({cfg.mla.kv_rank} + {cfg.mla.rope_dim} numbers per token and layer)")  # fmt: skip
        if cfg.n_kv_heads != cfg.attention.n_heads:
            mha = kv_cache_bytes(cfg.replace(attention={"n_kv_heads": None}), seq_len, batch, dtype)
            ratio = Fraction(kv, mha)
            out.append(
                f"  vs MHA ({cfg.attention.n_heads} KV heads) {human(mha)}: GQA keeps {ratio} of it (saves {1 - ratio})"
            )
    mem = training_bytes(cfg, seq_len, batch, dtype)
    out += [
        f"weights       {human(mem['weights'])}",
        f"training step {human(mem['total'])} = weights {human(mem['weights'])} + gradients "
        f"{human(mem['gradients'])} + AdamW state {human(mem['optimizer'])}"
        + (" (with fp32 master weights)" if as_dtype(dtype).itemsize < 4 else "")
        + f" + activations >= {human(mem['activations'])}",
    ]
    return out


def quantized_line(cfg: ModelConfig, dtype: str, scheme: str | None, group_size: int | None) -> str:
    """Weight bytes after weight-only quantization (what a decode step streams, nearly)."""
    if scheme is None:
        raise ValueError(f"--group-size={group_size} needs --quantize int4")
    q = weight_bytes(cfg, dtype, quantize=scheme, group_size=group_size)
    full = weight_bytes(cfg, dtype)
    group = f", group {group_size or DEFAULT_GROUP_SIZE}" if scheme == "int4" else ""
    return f"quantized     {scheme}{group}: weights {human(q)} ({q / full:.1%} of {human(full)} in {dtype})"


def run(args: argparse.Namespace) -> int:
    """Print a model's cost from its config alone (no weights are loaded; llama3-8b is instant).

    Parameters by part, FLOPs per token, KV-cache bytes (and the GQA saving against MHA), weight
    and training-step memory. FLOPs per token (forward) = 2 * N_matmul + 4 * L * T * H * E:
    every matmul weight (output projection included) once per token, plus QK^T and AV over
    seq_len keys; training = 3x forward. Give --tokens-per-second and --peak-tflops for MFU.

    torchformer plan llama3-8b --seq-len 8192 --dtype bfloat16
    torchformer plan llama3-8b --quantize int4 --group-size 128
    """
    cfg = config_of(args.model)
    seq_len = cfg.max_seq_len if args.seq_len is None else args.seq_len
    if seq_len < 1 or seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len={seq_len}: must be in [1, max_seq_len={cfg.max_seq_len}]")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size}: must be >= 1")
    dtype = str(as_dtype(args.dtype)).removeprefix("torch.")
    name = Path(args.model).name if Path(args.model).is_dir() else str(args.model)
    for line in lines_for(cfg, name, seq_len, args.batch_size, dtype):
        print(line)
    if args.quantize is not None or args.group_size is not None:
        print(quantized_line(cfg, dtype, args.quantize, args.group_size))
    if args.tokens_per_second is not None and args.peak_tflops is not None:
        peak = peak_flops(args.peak_tflops)
        util = mfu(args.tokens_per_second, flops_per_token(cfg, seq_len).training, peak)
        print(f"MFU           {util:.1%} at {args.tokens_per_second:,.0f} tokens/s of {peak / 1e12:.3g} TFLOP/s peak")
    return 0
