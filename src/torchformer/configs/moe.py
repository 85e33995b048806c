"""Mixture-of-experts MLPs and multi-head latent attention: one small frozen class each, so no
field is meaningless for a dense model. Re-exported by configs/__init__.py; imports no torch.

``MoE`` (Shazeer 2017; Switch, Fedus 2021; Mixtral, Jiang 2024; DeepSeekMoE, Dai 2024): a router
scores every token against ``n_experts`` gated MLPs of width ``d_expert``, each token goes to its
``top_k`` best. ``router`` "softmax" (Mixtral, Qwen-MoE) or "sigmoid" (DeepSeek-V3) makes the
scores; ``score_bias`` adds a learned per-expert bias used only to *choose* experts, never to weight
them (DeepSeek-V3 auxiliary-loss-free balancing, e_score_correction_bias); ``n_groups`` /
``topk_groups`` first keep the best groups of experts (group score: the sum of its two best
scores, DeepSeek-V3 node-limited routing); ``renormalize`` makes the chosen weights sum to 1
(Mixtral always, Qwen3-MoE ``norm_topk_prob``); ``routed_scale`` multiplies them afterwards
(DeepSeek-V3 routed_scaling_factor 2.5). ``n_shared`` always-on experts of total width
``d_shared`` (None: n_shared * d_expert, DeepSeek) are added to every token; ``shared_gate``
multiplies them by sigmoid(w . x) (Qwen2-MoE shared_expert_gate). ``dispatch`` "loop": one matmul
per expert over its sorted rows (any device and dtype); "grouped": torch's grouped_mm, one call per
projection (CPU fp32, CUDA bf16).

``LatentAttention`` (MLA, DeepSeek-V2 section 2.1): q optionally through a rank-``q_rank``
bottleneck with its own RMSNorm; keys and values from one ``kv_rank`` latent (RMSNorm'd) plus one
rotary key of width ``rope_dim`` shared by all heads; each head's query/key is ``nope_dim`` latent
features then ``rope_dim`` rotated ones, its value ``v_dim``. The cache stores the latent and the
rotary key only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .rules import _check, _check_choice, _Validated

Router = Literal["softmax", "sigmoid"]
Dispatch = Literal["loop", "grouped"]
MlpKind = Literal["dense", "moe"]


@dataclass(frozen=True, kw_only=True)
class MoE(_Validated):
    _prefix = "moe."

    n_experts: int
    top_k: int = 2
    d_expert: int | None = None
    router: Router = "softmax"
    renormalize: bool = True
    score_bias: bool = False
    n_groups: int = 1
    topk_groups: int = 1
    routed_scale: float = 1.0
    n_shared: int = 0
    d_shared: int | None = None
    shared_gate: bool = False
    dispatch: Dispatch = "loop"

    def _problems(self, p: list[str]) -> None:
        _check(p, self.n_experts >= 1, "moe.n_experts", self.n_experts, "must be >= 1")
        _check(p, 1 <= self.top_k <= max(self.n_experts, 1), "moe.top_k", self.top_k,
               f"must be in [1, n_experts={self.n_experts}]")  # fmt: skip
        if self.d_expert is not None:
            _check(p, self.d_expert >= 1, "moe.d_expert", self.d_expert, "must be >= 1 (or None: block.d_ff)")
        _check_choice(p, "moe.router", self.router, Router)
        _check_choice(p, "moe.dispatch", self.dispatch, Dispatch)
        _check(p, self.n_groups >= 1, "moe.n_groups", self.n_groups, "must be >= 1")
        if self.n_groups >= 1 and self.n_experts >= 1:
            _check(p, self.n_experts % self.n_groups == 0, "moe.n_groups", self.n_groups,
                   f"must divide n_experts={self.n_experts}")  # fmt: skip
            per_group = self.n_experts // self.n_groups
            _check(p, self.n_groups == 1 or per_group >= 2, "moe.n_groups", self.n_groups,
                   "groups need >= 2 experts each (a group scores by its two best)")  # fmt: skip
            _check(p, 1 <= self.topk_groups <= self.n_groups, "moe.topk_groups", self.topk_groups,
                   f"must be in [1, n_groups={self.n_groups}]")  # fmt: skip
            kept = self.topk_groups * per_group
            _check(p, kept >= self.top_k, "moe.topk_groups", self.topk_groups,
                   f"the kept groups hold {kept} experts, fewer than top_k={self.top_k}")  # fmt: skip
        _check(p, self.routed_scale > 0, "moe.routed_scale", self.routed_scale, "must be > 0")
        _check(p, self.n_shared >= 0, "moe.n_shared", self.n_shared, "must be >= 0")
        if self.d_shared is not None:
            _check(p, self.n_shared >= 1 and self.d_shared >= 1, "moe.d_shared", self.d_shared,
                   "must be >= 1 and needs n_shared >= 1")  # fmt: skip
        _check(p, not self.shared_gate or self.n_shared >= 1, "moe.shared_gate", self.shared_gate,
               "needs n_shared >= 1")  # fmt: skip

    def expert_width(self, d_ff: int) -> int:
        """Each routed expert's hidden width: ``d_expert``, else the dense ``d_ff``."""
        return d_ff if self.d_expert is None else self.d_expert

    def shared_width(self, d_ff: int) -> int:
        """The shared experts' hidden width: ``d_shared``, else ``n_shared`` expert widths."""
        return self.n_shared * self.expert_width(d_ff) if self.d_shared is None else self.d_shared


@dataclass(frozen=True, kw_only=True)
class LatentAttention(_Validated):
    _prefix = "mla."

    kv_rank: int
    q_rank: int | None = None
    nope_dim: int
    rope_dim: int
    v_dim: int
    mscale: float = 1.0  # softmax-scale multiplier (DeepSeek yarn: (0.1 * mscale_all_dim * ln f + 1) ** 2)

    def _problems(self, p: list[str]) -> None:
        for name in ("kv_rank", "nope_dim", "v_dim"):
            value = getattr(self, name)
            _check(p, value >= 1, f"mla.{name}", value, "must be >= 1")
        _check(p, self.rope_dim >= 2 and self.rope_dim % 2 == 0, "mla.rope_dim", self.rope_dim,
               "must be even and >= 2 (rotated in pairs)")  # fmt: skip
        if self.q_rank is not None:
            _check(p, self.q_rank >= 1, "mla.q_rank", self.q_rank, "must be >= 1 (or None: a full-rank q_proj)")
        _check(p, self.mscale > 0, "mla.mscale", self.mscale, "must be > 0")

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


def mixture_problems(cfg, p: list[str]) -> None:
    """Rules between ``moe`` / ``mla`` and the rest of a ModelConfig (checked by ModelConfig)."""
    if cfg.moe is not None:
        if not isinstance(cfg.moe, MoE):
            p.append(f"moe={cfg.moe!r}: must be a MoE or None")
        else:
            _check(p, cfg.block.mlp in ("swiglu", "geglu", "geglu_tanh"), "block.mlp", cfg.block.mlp,
                   "experts are gated MLPs: needs 'swiglu', 'geglu' or 'geglu_tanh' with moe")  # fmt: skip
            _check(p, not cfg.block.bias, "block.bias", cfg.block.bias, "must be False with moe (no expert biases)")
    if cfg.mla is None:
        return
    if not isinstance(cfg.mla, LatentAttention):
        p.append(f"mla={cfg.mla!r}: must be a LatentAttention or None")
        return
    a = cfg.attention
    _check(p, cfg.arch == "decoder", "mla", cfg.mla, f"latent attention is for arch 'decoder', not {cfg.arch!r}")
    _check(p, a.head_dim is None, "attention.head_dim", a.head_dim,
           "must be None with mla (mla.nope_dim, rope_dim and v_dim set the head widths)")  # fmt: skip
    _check(p, a.kv_heads == a.n_heads, "attention.n_kv_heads", a.n_kv_heads,
           "must be None (= n_heads) with mla: heads share the latent, not grouped K/V")  # fmt: skip
    _check(p, a.backend in ("math", "sdpa"), "attention.backend", a.backend, "must be 'math' or 'sdpa' with mla")
    for name in ("sliding_window", "softcap", "scale", "qk_norm"):
        value = getattr(a, name, None)
        _check(p, value is None, f"attention.{name}", value, "is not supported with mla (must be None)")
    kind = type(cfg.positions).__name__
    _check(p, cfg.positions is None or kind == "RoPE", "positions", kind, "mla needs RoPE (or None)")
    if kind == "RoPE":
        _check(p, cfg.positions.fraction == 1, "positions.fraction", cfg.positions.fraction,
               "must be 1 with mla (mla.rope_dim already sets the rotated width)")  # fmt: skip


def cache_widths(cfg) -> tuple[int, int, int]:
    """(heads, key width, value width) of one layer's self-attention cache entry per token: the
    K/V heads and head_dim, or with mla one shared "head" holding the latent (kv_rank) beside the
    rotary key (rope_dim), DeepSeek-V2's (d_c + d_h^R) numbers per token and layer."""
    if cfg.mla is not None:
        return 1, cfg.mla.kv_rank, cfg.mla.rope_dim
    return cfg.n_kv_heads, cfg.head_dim, cfg.head_dim
