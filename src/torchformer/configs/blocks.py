"""Attention and block configs (one residual block's heads, norms, MLP), re-exported by configs/__init__.py.
Imports no torch; every rule is checked in ``_problems`` and gathered by ModelConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .rules import _check, _check_choice, _Validated

# "rmsnorm_1p": RMSNorm times (1 + weight), weight starting at 0, all in fp32 (Gemma 1/2/3).
Norm = Literal["layernorm", "rmsnorm", "rmsnorm_1p"]
# "parallel": x + attn(norm1 x) + mlp(norm2 x) (GPT-NeoX use_parallel_residual); "parallel_shared":
# x + attn(n x) + mlp(n x) with one norm (GPT-J, Phi-2). Words of the one residual wiring, so
# placement stays a single choice (they exclude pre and post) and RESIDUALS stays one table.
Placement = Literal["pre", "post", "parallel", "parallel_shared", "output", "sandwich"]
# "output": x + norm(f(x)), the norm on each sublayer's output (OLMo 2); "sandwich": x + norm2(f(norm1 x))
# (Gemma 2/3: pre- and post-sublayer norms, both before the residual add).
QKNorm = Literal["head", "width"]
Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh"]
Backend = Literal["math", "sdpa", "flex", "auto"]
GATED: frozenset[str] = frozenset({"swiglu", "geglu", "geglu_tanh"})


@dataclass(frozen=True, kw_only=True)
class AttentionConfig(_Validated):
    """Heads and projections. n_kv_heads < n_heads is GQA, 1 is MQA; None means n_heads.

    ``bias`` covers the q/k/v projections; ``out_bias`` the output projection (None: same as bias;
    Qwen2 has q/k/v bias without an output bias). ``sliding_window`` limits each query to the
    last W keys (Mistral). ``backend``: "sdpa", "math" (the reference), "flex" (FlexAttention:
    biases and masks inside the kernel) or "auto" (the fastest exact path per forward; README).
    ``scale`` overrides the score scale 1/sqrt(head_dim) (T5: 1.0, Gemma 2:
    query_pre_attn_scalar ** -0.5); ``softcap`` caps scores as cap * tanh(score / cap) (Gemma 2: 50).
    ``qk_norm`` normalises q and k (the block's norm kind and eps) before RoPE: "head" over each
    head's features (Qwen3, Gemma 3), "width" over all heads' features at once (OLMo 2).
    """

    _prefix = "attention."

    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    bias: bool = False
    out_bias: bool | None = None
    dropout: float = 0.0
    backend: Backend = "sdpa"
    sliding_window: int | None = None
    scale: float | None = None
    softcap: float | None = None
    qk_norm: QKNorm | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def o_bias(self) -> bool:
        return self.bias if self.out_bias is None else self.out_bias

    def _problems(self, p: list[str]) -> None:
        _check(p, self.n_heads >= 1, "attention.n_heads", self.n_heads, "must be >= 1")
        kv = self.kv_heads
        _check(p, kv >= 1, "attention.n_kv_heads", self.n_kv_heads, "must be >= 1")
        if kv >= 1 and self.n_heads >= 1:
            _check(
                p,
                self.n_heads % kv == 0,
                "attention.n_kv_heads",
                self.n_kv_heads,
                f"must divide n_heads={self.n_heads} (GQA groups are equal)",
            )
        if self.head_dim is not None:
            _check(p, self.head_dim >= 1, "attention.head_dim", self.head_dim, "must be >= 1")
        _check(p, 0.0 <= self.dropout < 1.0, "attention.dropout", self.dropout, "must be in [0, 1)")
        _check_choice(p, "attention.backend", self.backend, Backend)
        if self.sliding_window is not None:
            _check(p, self.sliding_window >= 1, "attention.sliding_window", self.sliding_window, "must be >= 1")
        for name in ("scale", "softcap"):
            value = getattr(self, name)
            if value is not None:
                ok = isinstance(value, int | float) and math.isfinite(value) and value > 0
                _check(p, ok, f"attention.{name}", value, "must be a finite number > 0 (or None)")
        if self.qk_norm is not None:
            _check_choice(p, "attention.qk_norm", self.qk_norm, QKNorm)


@dataclass(frozen=True, kw_only=True)
class BlockConfig(_Validated):
    """One residual block: norm kind and placement, MLP kind and width, dropout.

    d_ff None picks the default: 4 * d_model, or for gated MLPs 8/3 * d_model rounded up to a
    multiple of 256 (Llama: 4096 -> 11008), which keeps the parameter count of a 4x ungated MLP.
    """

    _prefix = "block."

    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True
    norm_placement: Placement = "pre"
    mlp: Activation = "gelu"
    d_ff: int | None = None
    bias: bool = False
    dropout: float = 0.0

    def _problems(self, p: list[str]) -> None:
        _check_choice(p, "block.norm", self.norm, Norm)
        _check_choice(p, "block.norm_placement", self.norm_placement, Placement)
        _check_choice(p, "block.mlp", self.mlp, Activation)
        _check(p, self.norm_eps > 0, "block.norm_eps", self.norm_eps, "must be > 0")
        if self.d_ff is not None:
            _check(p, self.d_ff >= 1, "block.d_ff", self.d_ff, "must be >= 1")
        _check(p, 0.0 <= self.dropout < 1.0, "block.dropout", self.dropout, "must be in [0, 1)")


def default_d_ff(d_model: int, mlp: str) -> int:
    """4 * d_model; gated: 8/3 * d_model rounded up to a multiple of 256."""
    if mlp in GATED:
        return 256 * math.ceil(8 * d_model / 3 / 256)
    return 4 * d_model
