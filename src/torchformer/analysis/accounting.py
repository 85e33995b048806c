"""Cost accounting from a config alone: parameters (exact), FLOPs, KV-cache bytes, memory, MFU.

Nothing here allocates a model: parameters are counted on the meta device, the rest is arithmetic
on the config, so llama3-8b is planned in milliseconds on a laptop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..configs import GATED, ModelConfig
from .moe_accounting import active_params, attention_flops, cache_numbers_per_token, stack_matmul_params

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
PARTS = ("embeddings", "attention", "mlp", "norms", "positions", "lm_head")


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch dtype from a dtype or one of the names in DTYPES."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be a torch.dtype or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def dtype_bytes(dtype: torch.dtype | str) -> int:
    return torch.empty((), dtype=as_dtype(dtype)).element_size()


@lru_cache(maxsize=64)
def _numels(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(name, numel) of every parameter, tied tensors once, from a meta-device build."""
    from ..models.build import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    return tuple((name, p.numel()) for name, p in model.named_parameters())


def count_params(cfg: ModelConfig, *, active: bool = False) -> int:
    """Exact parameter count (tied tensors once), by building the model on the meta device:
    no memory is allocated, so llama3-8b counts in milliseconds. active=True: the parameters one
    token uses (of each MoE layer's routed experts only top_k; moe_accounting.py).

    >>> import torchformer as tfm
    >>> tfm.count_params(tfm.presets.get("gpt2-small"))  # GPT-2's published 124M, tied head once
    124439808
    >>> mixtral = tfm.presets.get("mixtral-8x7b")
    >>> round(tfm.count_params(mixtral) / 1e9, 1), round(tfm.count_params(mixtral, active=True) / 1e9, 1)
    (46.7, 12.9)
    """
    return active_params(_numels(cfg), cfg) if active else sum(n for _, n in _numels(cfg))


def _part_of(name: str) -> str:
    """Which part a parameter name belongs to (state-dict names, DESIGN section 5)."""
    leaf = name.split(".")
    if "score_bias" in leaf or "absolute" in leaf:
        return "positions"
    if any(part.endswith("norm") for part in leaf):
        return "norms"
    if "attn" in leaf or "cross_attn" in leaf:
        return "attention"
    if "mlp" in leaf:
        return "mlp"
    if leaf[0] == "lm_head":
        return "lm_head"
    return "embeddings"  # token tables and token types


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part: embeddings (token tables, token types), attention (q/k/v/o of self and
    cross), mlp, norms, positions (learned tables, relative bias) and lm_head (untied head and its
    bias; a tied head is counted once, under embeddings). Sums to ``count_params(cfg)``."""
    out = dict.fromkeys(PARTS, 0)
    for name, n in _numels(cfg):
        out[_part_of(name)] += n
    return out


def _layer_matmul_params(cfg: ModelConfig, cross: bool) -> int:
    """Weights of the matmuls in one block: q, o (H*E x D), k, v (K*E x D), the MLP (2 or 3 x D x d_ff)."""
    d, h, kv, e = cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn = 2 * d * h * e + 2 * d * kv * e
    mlp = (3 if cfg.block.mlp in GATED else 2) * d * cfg.d_ff
    return attn * (2 if cross else 1) + mlp


@dataclass(frozen=True)
class Flops:
    """Matmul FLOPs per token: ``forward`` and ``training`` (= 3 x forward)."""

    forward: int
    training: int


def flops_per_token(cfg: ModelConfig, seq_len: int) -> Flops:
    """Matmul FLOPs per token at context ``seq_len`` (one multiply-add = 2 FLOPs).

    forward = 2 * N_matmul + 4 * n_attn_layers * seq_len * n_heads * head_dim, where
      N_matmul = sum over blocks of the q, k, v, o and MLP weights, plus d_model * vocab_size for
        the output projection (counted even when tied: it is still a matmul); embedding and
        position lookups are not matmuls and cost nothing;
      the attention term is QK^T (2 * T * H * E per query) plus AV (the same), over the full
        seq_len keys for every query: the convention of PaLM (Chowdhery et al. 2022, app. B) and
        nanoGPT's MFU, so MFU figures compare with theirs (a causal kernel that skips the upper
        triangle does about half of this term).
    training = 3 * forward (the backward pass costs two matmuls per forward matmul).

    Encoders have no output projection (the MLM head is optional). Encoder-decoders count one
    source token and one target token at the same ``seq_len``: encoder blocks + decoder blocks
    (self- and cross-attention over seq_len keys each) + the output projection.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: must be an integer >= 1")
    attn_per_layer = attention_flops(cfg, seq_len)
    head = cfg.d_model * cfg.vocab_size
    if cfg.moe is not None or cfg.mla is not None:  # decoders only: active experts, MLA's projections
        n, attn = stack_matmul_params(cfg) + head, cfg.n_layers * attn_per_layer
    elif cfg.arch == "decoder":
        n, attn = cfg.n_layers * _layer_matmul_params(cfg, False) + head, cfg.n_layers * attn_per_layer
    elif cfg.arch == "encoder":
        n, attn = cfg.n_layers * _layer_matmul_params(cfg, False), cfg.n_layers * attn_per_layer
    else:
        dec = cfg.decoder_layers
        n = cfg.n_layers * _layer_matmul_params(cfg, False) + dec * _layer_matmul_params(cfg, True) + head
        attn = (cfg.n_layers + 2 * dec) * attn_per_layer
    forward = 2 * n + attn
    return Flops(forward=forward, training=3 * forward)


def kv_cache_bytes(
    cfg: ModelConfig, seq_len: int, batch_size: int = 1, dtype: torch.dtype | str = torch.float32
) -> int:
    """Bytes of the self-attention KV cache: 2 (K and V) * n_layers * n_kv_heads * head_dim *
    seq_len * batch_size * bytes per element. n_layers is the decoder's for encoder-decoders
    (whose cross-attention K/V add the same formula at the source length); encoders keep no
    cache and return 0. GQA divides it by n_heads / n_kv_heads against MHA. Latent attention
    (mla) stores kv_rank + rope_dim numbers per token and layer instead.

    >>> import torch, torchformer as tfm
    >>> tfm.kv_cache_bytes(tfm.presets.get("llama3-8b"), 8192, 1, torch.bfloat16) / 2**30  # 2*32*8*128*8192*2 B
    1.0
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if cfg.arch == "encoder":
        return 0
    per_token = cache_numbers_per_token(cfg)  # 2 * n_kv_heads * head_dim, or MLA's latent + rotary key
    return cfg.decoder_layers * per_token * seq_len * batch_size * dtype_bytes(dtype)


def activation_bytes(
    cfg: ModelConfig, seq_len: int, batch_size: int = 1, dtype: torch.dtype | str = torch.float32
) -> int:
    """Estimate of the activations a training step keeps for backward (fused SDPA attention).

    Per token and block, the tensors autograd saves: the two norm inputs and outputs (4 D), q, k,
    v after rotation (H*E + 2*K*E), the attention output and its log-sum-exp (H*E + H), the
    MLP's hidden (2 d_ff, or 4 d_ff gated: gate, up, act(gate), product); plus the final norm
    (2 D) and the logits with their softmax (2 V, fp32 in the loss). Dropout masks, the math
    backend's (H, T, S) weights and allocator slack are not counted: take it as a lower bound.
    """
    d, h, kv, e, ff = cfg.d_model, cfg.attention.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    mlp = (4 if cfg.block.mlp in GATED else 2) * ff
    attn = h * e + 2 * kv * e + h * e + h
    per_block = 4 * d + attn + mlp
    blocks = cfg.n_layers * per_block
    if cfg.arch == "encoder_decoder":
        blocks += cfg.decoder_layers * (per_block + 2 * d + 2 * h * e + h)  # + cross sublayer
    tokens = seq_len * batch_size
    head = 0 if cfg.arch == "encoder" else 2 * cfg.vocab_size * tokens * 4
    return tokens * (blocks + 2 * d) * dtype_bytes(dtype) + head


def training_bytes(
    cfg: ModelConfig, seq_len: int, batch_size: int = 1, dtype: torch.dtype | str = torch.float32
) -> dict[str, int]:
    """Memory of one AdamW training step: weights, gradients, optimizer state (two fp32 moments,
    plus fp32 master weights when training in 16 bits) and activations (``activation_bytes``)."""
    n, b = count_params(cfg), dtype_bytes(dtype)
    master = 4 * n if b < 4 else 0
    parts = {
        "weights": n * b,
        "gradients": n * b,
        "optimizer": 8 * n + master,
        "activations": activation_bytes(cfg, seq_len, batch_size, dtype),
    }
    parts["total"] = sum(parts.values())
    return parts


def weight_bytes(
    cfg: ModelConfig,
    dtype: torch.dtype | str = torch.float32,
    *,
    quantize: str | None = None,
    group_size: int | None = None,
    lm_head: bool = True,
) -> int:
    """Bytes of the weights as ``tfm.save`` stores them: float tensors in ``dtype``, and with
    ``quantize`` ("int8" | "int4", see ``tfm.quantize``) the integer weights plus their fp32 scales
    (int8: N*K + 4N per projection; int4: N*K/2 + 4*N*K/group_size) and a tied head's quantized
    copy. Exact: the model is built and quantized on the meta device, where nothing is allocated."""
    from ..models.build import build_model
    from ..models.quantize import quantize as quantize_model
    from ..models.saving import unique_state

    dt = as_dtype(dtype)
    with torch.device("meta"):
        model = build_model(cfg).to(dt)
        if quantize is not None:
            quantize_model(model, quantize, group_size=group_size, lm_head=lm_head)
    return sum(t.numel() * t.element_size() for t in unique_state(model).values())


def mfu(tokens_per_second: float, flops_per_token: int | float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s (tokens/s x FLOPs per token, e.g.
    ``flops_per_token(cfg, T).training``) over ``peak_flops`` (FLOP/s, stated or measured with
    ``matmul_peak_flops``)."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops!r}: must be > 0 (FLOP/s)")
    return tokens_per_second * flops_per_token / peak_flops


def matmul_peak_flops(size: int = 1024, repeats: int = 5, dtype: torch.dtype | str = torch.float32,
                      device: torch.device | str = "cpu") -> float:  # fmt: skip
    """A measured peak: the best FLOP/s of ``repeats`` square ``size`` matmuls on ``device``. The
    matrices come from a generator of their own: no global random stream moves."""
    device = torch.device(device)
    g = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(size, size, generator=g, device=device).to(as_dtype(dtype)) for _ in range(2))
    sync = (lambda: None) if device.type == "cpu" else (lambda: torch.accelerator.synchronize(device))
    a @ b  # warm up the kernels and the allocator
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
