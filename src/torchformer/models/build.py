"""THE place where config words become classes and functions. Every choice is a literal table,
so one file lists every option; after build, no forward reads the config or compares a string.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..configs import ModelConfig
from ..nn.attention import Attention
from ..nn.block import Block, parallel, parallel_shared, post_norm, pre_norm
from ..nn.head import LMHead
from ..nn.linear import Linear
from ..nn.mlp import MLP, GatedMLP
from ..nn.norms import LayerNorm, OffsetRMSNorm, RMSNorm
from ..nn.positions import LearnedPositions, RelativePositionBias
from ..nn.quant import Int4Linear, Int8Linear

# The attention and position tables live beside their builders; re-exported so this file still
# names every option (and callers keep importing them from here).
from .build_attention import BACKENDS, PREPARES, QK_NORMS, flex_runs, prepare, qk_norms  # noqa: F401
from .build_moe import init_experts, latent_attention, moe_mlp
from .build_positions import (  # noqa: F401
    ROTATIONS,
    SINUSOID_LAYOUTS,
    absolute_positions,
    rope_table,
    rotary,
    score_bias,
)
from .decoder import DecoderLM
from .encoder import Encoder, by_column, by_count
from .encoder_decoder import EncoderDecoder
from .kinds import resolve_kinds
from .stack import Embeddings, KindContext, Stack, embed_scale, times, times_in_dtype

NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, "rmsnorm_1p": OffsetRMSNorm}
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
RESIDUALS = {"pre": pre_norm, "post": post_norm, "parallel": parallel, "parallel_shared": parallel_shared,
             "output": pre_norm, "sandwich": pre_norm}  # fmt: skip
# placement -> (a norm before each sublayer, a norm on its output before the residual add)
SUBLAYER_NORMS = {"output": (False, True), "sandwich": (True, True)}  # others: (True, False)
ENCODER_POSITIONS = {"columns": by_column, "counted": by_count}  # encoder_positions -> numbering (RoBERTa: counted)
EMBED_PRODUCTS = {False: times, True: times_in_dtype}  # embed_scale_in_dtype -> the product (Gemma: True)
QUANT_LINEARS = {"int8": Int8Linear, "int4": Int4Linear}  # tfm.quantize scheme -> module (weight-only)


def norm(cfg: ModelConfig) -> nn.Module:
    b = cfg.block
    return NORMS[b.norm](cfg.d_model, eps=b.norm_eps, bias=b.norm_bias)


def later_norm(cfg: ModelConfig) -> nn.Module:
    """The norm of a block's second and third sublayers; "parallel_shared" reuses the first one's
    (GPT-J, Phi-2), so these are Identity there and hold no weights."""
    return nn.Identity() if cfg.block.norm_placement == "parallel_shared" else norm(cfg)


def dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


def attention(cfg: ModelConfig, rotate: Callable | None) -> nn.Module:
    a = cfg.attention
    if cfg.mla is not None:  # DeepSeek-V2/V3 multi-head latent attention (build_moe.py)
        return latent_attention(cfg, rotate, BACKENDS[a.backend])
    q_norm, k_norm = qk_norms(cfg, width_norm(cfg))
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
        q_norm=q_norm,
        k_norm=k_norm,
    )


def width_norm(cfg: ModelConfig) -> Callable[[int], nn.Module]:
    """The block's norm kind at another width (QK-norm)."""
    b = cfg.block
    return lambda width: NORMS[b.norm](width, eps=b.norm_eps, bias=b.norm_bias)


def mlp(cfg: ModelConfig, kind: str) -> nn.Module:
    """The MLP of a layer whose MLP kind is ``kind``: "dense" (the block's MLP) or "moe" (experts)."""
    mlp_cls, act = MLPS[cfg.block.mlp]
    table = {
        "dense": lambda: mlp_cls(cfg.d_model, cfg.d_ff, ACTIVATIONS[act], cfg.block.bias),
        "moe": lambda: moe_mlp(cfg, ACTIVATIONS[act]),
    }
    return table[kind]()


def block(cfg: ModelConfig, rotate: Callable | None, cross: bool, mlp_kind: str = "dense") -> Block:
    before, after = SUBLAYER_NORMS.get(cfg.block.norm_placement, (True, False))
    return Block(
        attention(cfg, rotate),
        norm(cfg) if before else nn.Identity(),
        mlp(cfg, mlp_kind),  # the layer kind's MLP: dense or experts
        later_norm(cfg) if before else nn.Identity(),
        residual=RESIDUALS[cfg.block.norm_placement],
        dropout=dropout(cfg.block.dropout),
        cross_attn=attention(cfg, None) if cross else None,
        cross_norm=later_norm(cfg) if cross else None,
        attn_out_norm=norm(cfg) if after else None,  # Gemma 2/3 post_attention_layernorm, OLMo 2
        mlp_out_norm=norm(cfg) if after else None,  # post_feedforward_layernorm
    )


def stack(cfg: ModelConfig, n_layers: int, *, causal: bool, cross: bool = False) -> Stack:
    """The blocks of ``n_layers`` layers; each layer kind (configs/layers.py) gets its RoPE table
    (one per distinct RoPE config) and window, each block its kind's rotation."""
    kinds, layer_kind = resolve_kinds(cfg, n_layers)
    tables: dict = {}
    for kind in kinds:
        if kind.rope not in tables:
            tables[kind.rope] = rotary(cfg, kind.rope)
    contexts = [KindContext(tables[k.rope][0], k.sliding_window if causal else None) for k in kinds]
    return Stack(
        [block(cfg, tables[kinds[i].rope][1], cross, kinds[i].mlp) for i in layer_kind],
        norm(cfg) if cfg.has_final_norm else nn.Identity(),
        causal=causal,
        rope=contexts[0].rope,
        score_bias=score_bias(cfg, causal),
        window=contexts[0].window,
        n_heads=cfg.attention.n_heads,
        prepare=prepare(cfg),
        kinds=contexts[1:],
        layer_kind=layer_kind,
    )


def embedding(n: int, dim: int) -> nn.Embedding:
    """An uninitialised table (init_weights fills it). nn.Embedding's own normal_ would, on the meta
    device (count_params, load), import torch._dynamo: ~5 s the first time in a process."""
    return nn.Embedding(n, dim, _weight=torch.empty(n, dim))


def embeddings(cfg: ModelConfig, tok: nn.Embedding, token_types: int = 0) -> Embeddings:
    return Embeddings(
        tok,
        scale=embed_scale(cfg.embed_scale, cfg.d_model),
        multiply=EMBED_PRODUCTS[cfg.embed_scale_in_dtype],
        absolute=absolute_positions(cfg),
        token_types=embedding(token_types, cfg.d_model) if token_types else None,
        norm=norm(cfg) if cfg.embed_norm else None,
        dropout=dropout(cfg.dropout),
    )


def lm_head(cfg: ModelConfig, tok: nn.Embedding) -> nn.Linear:
    """The output projection; with head_scale (T5) or final_softcap (Gemma 2) an LMHead that
    applies them (same weights and state-dict keys)."""
    if cfg.head_scale is None and cfg.final_softcap is None:
        head = Linear(cfg.d_model, cfg.vocab_size, bias=cfg.final_logits_bias)
    else:
        head = LMHead(cfg.d_model, cfg.vocab_size, bias=cfg.final_logits_bias, scale=cfg.head_scale,
                      softcap=cfg.final_softcap)  # fmt: skip
    if cfg.tie_embeddings:
        head.weight = tok.weight
    return head


def build_model(cfg: ModelConfig) -> nn.Module:
    """DecoderLM, Encoder or EncoderDecoder for ``cfg``, initialised (see ``init_weights``).

    Build under ``torch.device("meta")`` to count parameters of a large model without memory.
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"build_model needs a ModelConfig, got {type(cfg).__name__}")
    tok = embedding(cfg.vocab_size, cfg.d_model)
    if cfg.arch == "decoder":
        model = DecoderLM(cfg, embeddings(cfg, tok), stack(cfg, cfg.n_layers, causal=True), lm_head(cfg, tok))
    elif cfg.arch == "encoder":
        model = Encoder(
            cfg,
            embeddings(cfg, tok, cfg.n_token_types),
            stack(cfg, cfg.n_layers, causal=False),
            ENCODER_POSITIONS[cfg.encoder_positions],
        )
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
    init_experts(model, cfg.init_std, depth_scale)  # batched expert weights and routers (not Linears)
