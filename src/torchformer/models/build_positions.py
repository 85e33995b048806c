"""Position words -> modules (split from build.py by concern): the absolute term added to the
embeddings, the RoPE table and rotation of a RoPE config (one per layer kind), score biases."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from ..configs import (
    ALiBi,
    DynamicNTK,
    Learned,
    LinearScaling,
    Llama3Scaling,
    LongRoPE,
    ModelConfig,
    RelativeBias,
    RoPE,
    Sinusoidal,
    YaRN,
)
from ..nn.positions import (
    ALiBiBias,
    LearnedPositions,
    RelativePositionBias,
    RotaryTable,
    SinusoidalPositions,
    interleave_sin_cos,
    rotate_half,
    rotate_interleaved,
    rotate_partial,
    split_sin_cos,
)
from ..nn.rope_scaling import (
    DynamicNTKTable,
    LongRoPETable,
    linear_inv_freq,
    llama3_inv_freq,
    longrope_attention_factor,
    longrope_inv_freq,
    yarn_attention_factor,
    yarn_inv_freq,
)

ROTATIONS = {"half": rotate_half, "interleaved": rotate_interleaved}
SINUSOID_LAYOUTS = {"interleaved": interleave_sin_cos, "split": split_sin_cos}
_MODEL = object()  # rotary(cfg): the model-level positions


def absolute_positions(cfg: ModelConfig) -> nn.Module | None:
    """The (B, T, D) term added to the embeddings, for the absolute schemes."""
    pos = cfg.positions
    table = {
        Sinusoidal: lambda: SinusoidalPositions(cfg.max_seq_len, cfg.d_model, pos.base, SINUSOID_LAYOUTS[pos.layout]),
        Learned: lambda: LearnedPositions(cfg.max_seq_len, cfg.d_model, pos.offset),
    }
    make = table.get(type(pos))
    return None if make is None else make()


def rotary(cfg: ModelConfig, rope: RoPE | None | object = _MODEL) -> tuple[nn.Module | None, Callable | None]:
    """The RoPE table and the rotation of ``rope`` (default: the model's positions; a layer kind
    passes its own, None for NoPE); partial rotary turns only the first ``dim`` features."""
    rope = cfg.positions if rope is _MODEL else rope
    if not isinstance(rope, RoPE):
        return None, None
    dim, rotate = rope.rotary_dim(cfg.head_dim), ROTATIONS[rope.pairing]
    if dim < cfg.head_dim:
        rotate = partial(rotate_partial, dim=dim, rotate=rotate)
    return rope_table(cfg, dim, rope), rotate


def rope_table(cfg: ModelConfig, dim: int, rope: RoPE | None = None) -> nn.Module:
    """cos/sin rows over ``dim`` rotated features, one entry per scaling scheme (formulas in
    nn/rope_scaling.py). Static schemes fix their frequencies; dynamic and longrope follow the length."""
    rope = cfg.positions if rope is None else rope
    n, base, s = cfg.max_seq_len, rope.base, rope.scaling
    table = {
        type(None): lambda: RotaryTable(dim, base),
        LinearScaling: lambda: RotaryTable(dim, base, inv_freq=linear_inv_freq(dim, base, s.factor)),
        Llama3Scaling: lambda: RotaryTable(
            dim,
            base,
            inv_freq=llama3_inv_freq(
                dim, base, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_seq_len
            ),
        ),
        YaRN: lambda: RotaryTable(
            dim,
            base,
            inv_freq=yarn_inv_freq(
                dim, base, s.resolved_factor(n), s.original_max_seq_len, s.beta_fast, s.beta_slow, s.truncate
            ),
            attention_factor=yarn_attention_factor(
                s.resolved_factor(n), s.attention_factor, s.mscale, s.mscale_all_dim
            ),
        ),
        LongRoPE: lambda: LongRoPETable(
            longrope_inv_freq(dim, base, s.short_factor),
            longrope_inv_freq(dim, base, s.long_factor),
            s.original_max_seq_len,
            longrope_attention_factor(s.resolved_factor(n), s.original_max_seq_len, s.attention_factor),
        ),
        DynamicNTK: lambda: DynamicNTKTable(dim, base, s.factor, s.original_max_seq_len),
    }
    return table[type(s)]()


def score_bias(cfg: ModelConfig, causal: bool) -> nn.Module | None:
    pos, heads = cfg.positions, cfg.attention.n_heads
    table = {
        ALiBi: lambda: ALiBiBias(heads),
        RelativeBias: lambda: RelativePositionBias(
            heads, pos.num_buckets, pos.max_distance, not causal, max_len=cfg.max_seq_len
        ),
    }
    make = table.get(type(pos))
    return None if make is None else make()
