"""THE place where config words become classes and functions. Every choice is a literal table,
so one file lists every option; after build, no forward reads the config or compares a string.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import (
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
from ..nn import flex
from ..nn.attention import Attention
from ..nn.backends import math_attention, sdpa_attention
from ..nn.block import Block, parallel, parallel_shared, post_norm, pre_norm
from ..nn.linear import Linear
from ..nn.mlp import MLP, GatedMLP
from ..nn.norms import LayerNorm, RMSNorm
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
from ..nn.quant import Int4Linear, Int8Linear
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
from ..nn.routing import auto_attention, auto_preparer, prepare_dense, prepare_flex
from .stack import Embeddings, Stack, embed_scale

NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact erf form (BERT)
    "gelu_tanh": partial(F.gelu, approximate="tanh"),  # GPT-2's gelu_new
    "silu": F.silu,  # a.k.a. swish (Marian)
}
MLPS = {  # mlp word -> (module, activation)
    "relu": (MLP, "relu"),
    "gelu": (MLP, "gelu"),
    "gelu_tanh": (MLP, "gelu_tanh"),
    "silu": (MLP, "silu"),
    "swiglu": (GatedMLP, "silu"),
    "geglu": (GatedMLP, "gelu"),
    "geglu_tanh": (GatedMLP, "gelu_tanh"),  # T5 v1.1 / Flan-T5 "gated-gelu": gelu_new(wi_0 x) * wi_1 x
}
BACKENDS = {"math": math_attention, "sdpa": sdpa_attention, "flex": flex.flex_attention, "auto": auto_attention}
PREPARES = {  # backend word -> what its context needs, built once per forward (nn/routing.py)
    "math": lambda softcap, flex_ok: prepare_dense,
    "sdpa": lambda softcap, flex_ok: prepare_dense,
    "flex": lambda softcap, flex_ok: prepare_flex,
    "auto": auto_preparer,
}
RESIDUALS = {"pre": pre_norm, "post": post_norm, "parallel": parallel, "parallel_shared": parallel_shared}
ROTATIONS = {"half": rotate_half, "interleaved": rotate_interleaved}
SINUSOID_LAYOUTS = {"interleaved": interleave_sin_cos, "split": split_sin_cos}
QUANT_LINEARS = {"int8": Int8Linear, "int4": Int4Linear}  # tfm.quantize scheme -> module (weight-only)


def absolute_positions(cfg: ModelConfig) -> nn.Module | None:
    """The (B, T, D) term added to the embeddings, for the absolute schemes."""
    pos = cfg.positions
    table = {
        Sinusoidal: lambda: SinusoidalPositions(cfg.max_seq_len, cfg.d_model, pos.base, SINUSOID_LAYOUTS[pos.layout]),
        Learned: lambda: LearnedPositions(cfg.max_seq_len, cfg.d_model, pos.offset),
    }
    make = table.get(type(pos))
    return None if make is None else make()


def rotary(cfg: ModelConfig) -> tuple[nn.Module | None, Callable | None]:
    """The RoPE table and the rotation; partial rotary turns only the first ``dim`` features."""
    if not isinstance(cfg.positions, RoPE):
        return None, None
    dim, rotate = cfg.positions.rotary_dim(cfg.head_dim), ROTATIONS[cfg.positions.pairing]
    if dim < cfg.head_dim:
        rotate = partial(rotate_partial, dim=dim, rotate=rotate)
    return rope_table(cfg, dim), rotate


def rope_table(cfg: ModelConfig, dim: int) -> nn.Module:
    """cos/sin rows over ``dim`` rotated features, one entry per scaling scheme (formulas in
    nn/rope_scaling.py). Static schemes precompute a table; dynamic and longrope follow the length."""
    n, base, s = cfg.max_seq_len, cfg.positions.base, cfg.positions.scaling
    table = {
        type(None): lambda: RotaryTable(n, dim, base),
        LinearScaling: lambda: RotaryTable(n, dim, base, inv_freq=linear_inv_freq(dim, base, s.factor)),
        Llama3Scaling: lambda: RotaryTable(
            n,
            dim,
            base,
            inv_freq=llama3_inv_freq(
                dim, base, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_seq_len
            ),
        ),
        YaRN: lambda: RotaryTable(
            n,
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


def norm(cfg: ModelConfig) -> nn.Module:
    b = cfg.block
    return NORMS[b.norm](cfg.d_model, eps=b.norm_eps, bias=b.norm_bias)


def later_norm(cfg: ModelConfig) -> nn.Module:
    """The norm of a block's second and third sublayers; "parallel_shared" reuses the first one's
    (GPT-J, Phi-2), so these are Identity there and hold no weights."""
    return nn.Identity() if cfg.block.norm_placement == "parallel_shared" else norm(cfg)


def dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


def attention(cfg: ModelConfig, rotate: Callable | None) -> Attention:
    a = cfg.attention
    return Attention(
        cfg.d_model,
        a.n_heads,
        a.kv_heads,
        cfg.head_dim,
        bias=a.bias,
        out_bias=a.o_bias,
        dropout=a.dropout,
        backend=BACKENDS[a.backend],
        rotate=rotate,
        scale=a.scale,
        softcap=a.softcap,
    )


def block(cfg: ModelConfig, rotate: Callable | None, cross: bool) -> Block:
    mlp_cls, act = MLPS[cfg.block.mlp]
    return Block(
        attention(cfg, rotate),
        norm(cfg),
        mlp_cls(cfg.d_model, cfg.d_ff, ACTIVATIONS[act], cfg.block.bias),
        later_norm(cfg),
        residual=RESIDUALS[cfg.block.norm_placement],
        dropout=dropout(cfg.block.dropout),
        cross_attn=attention(cfg, None) if cross else None,
        cross_norm=later_norm(cfg) if cross else None,
    )


def stack(cfg: ModelConfig, n_layers: int, *, causal: bool, cross: bool = False) -> Stack:
    rope, rotate = rotary(cfg)
    return Stack(
        [block(cfg, rotate, cross) for _ in range(n_layers)],
        norm(cfg) if cfg.has_final_norm else nn.Identity(),
        causal=causal,
        rope=rope,
        score_bias=score_bias(cfg, causal),
        window=cfg.attention.sliding_window if causal else None,
        n_heads=cfg.attention.n_heads,
        prepare=PREPARES[cfg.attention.backend](cfg.attention.softcap, flex_runs(cfg.attention.backend)),
    )


def flex_runs(backend: str) -> bool:
    """Whether flex can run here: "flex" forced where it cannot is an error, "auto" warns once
    and keeps to the dense paths."""
    reason = flex.unavailable_reason(torch.get_default_device()) if backend in ("flex", "auto") else None
    if reason is not None and backend == "flex":
        raise ValueError(f"attention.backend='flex' cannot run here: {reason}; use 'auto', 'sdpa' or 'math'")
    if reason is not None:
        warnings.warn(f"attention.backend='auto' will not use flex: {reason}", stacklevel=3)
    return reason is None


def embedding(n: int, dim: int) -> nn.Embedding:
    """An uninitialised table (init_weights fills it). nn.Embedding's own normal_ would, on the meta
    device (count_params, load), import torch._dynamo: ~5 s the first time in a process."""
    return nn.Embedding(n, dim, _weight=torch.empty(n, dim))


def embeddings(cfg: ModelConfig, tok: nn.Embedding, token_types: int = 0) -> Embeddings:
    return Embeddings(
        tok,
        scale=embed_scale(cfg.embed_scale, cfg.d_model),
        absolute=absolute_positions(cfg),
        token_types=embedding(token_types, cfg.d_model) if token_types else None,
        norm=norm(cfg) if cfg.embed_norm else None,
        dropout=dropout(cfg.dropout),
    )


def lm_head(cfg: ModelConfig, tok: nn.Embedding) -> nn.Linear:
    head = Linear(cfg.d_model, cfg.vocab_size, bias=cfg.final_logits_bias)
    if cfg.tie_embeddings:
        head.weight = tok.weight
    return head


def build_model(cfg: ModelConfig) -> nn.Module:
    """DecoderLM, Encoder or EncoderDecoder for ``cfg``, initialised (see ``init_weights``).

    Build under ``torch.device("meta")`` to count parameters of a large model without memory.
    """
    from .decoder import DecoderLM
    from .encoder import Encoder
    from .encoder_decoder import EncoderDecoder

    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"build_model needs a ModelConfig, got {type(cfg).__name__}")
    tok = embedding(cfg.vocab_size, cfg.d_model)
    if cfg.arch == "decoder":
        model = DecoderLM(cfg, embeddings(cfg, tok), stack(cfg, cfg.n_layers, causal=True), lm_head(cfg, tok))
    elif cfg.arch == "encoder":
        model = Encoder(cfg, embeddings(cfg, tok, cfg.n_token_types), stack(cfg, cfg.n_layers, causal=False))
    else:
        tgt_tok = tok if cfg.share_embeddings else embedding(cfg.vocab_size, cfg.d_model)
        model = EncoderDecoder(
            cfg,
            embeddings(cfg, tok),
            stack(cfg, cfg.n_layers, causal=False),
            embeddings(cfg, tgt_tok),
            stack(cfg, cfg.decoder_layers, causal=True, cross=True),
            lm_head(cfg, tgt_tok),
        )
    init_weights(model, cfg)
    return model


RESIDUAL_OUTPUTS = ("o_proj", "down")


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """normal: N(0, init_std) for matrices and tables, with the projections that write into the
    residual stream (o_proj, mlp.down) scaled by 1/sqrt(2 * n_layers) (GPT-2) so the residual's
    variance does not grow with depth. xavier: Glorot-uniform for every matrix (the 2017 base
    model as The Annotated Transformer initialises it). Biases 0, norm weights 1."""
    depth_scale = 1 / math.sqrt(2 * max(cfg.n_layers, cfg.decoder_layers))
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding | LearnedPositions | RelativePositionBias):
            if module.weight.is_meta:  # nothing to fill, and meta normal_ imports torch._dynamo
                continue
            if cfg.init == "xavier":
                nn.init.xavier_uniform_(module.weight)
            else:
                scale = depth_scale if name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS else 1.0
                nn.init.normal_(module.weight, std=cfg.init_std * scale)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
