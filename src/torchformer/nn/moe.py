"""Mixture-of-experts MLP: a router, batched gated experts and optional shared experts.

Legend: N tokens (B * T flattened), D model width, E experts, F expert width, k experts per token.
The router scores every token (a bias-free linear, then softmax or sigmoid, chosen at build time),
keeps each token's top k (optionally within the best groups, DeepSeek-V3) and weights them.
Dispatch sorts the N * k (token, expert) pairs by expert so each expert runs one matrix product
over a contiguous slice of its tokens, then the weighted outputs are added back per token
(index_add_): dropless, no capacity factor, no loop per token. Routing choices (which experts
each token picked, the router logits) are reported to an explicit ``RouterRecord`` when one is
attached by ``record_routing`` (training's balancing losses read it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import Linear


def softmax_scores(logits: Tensor) -> Tensor:
    """Mixtral / Qwen-MoE: probabilities over all experts, in fp32."""
    return logits.float().softmax(-1)


def sigmoid_scores(logits: Tensor) -> Tensor:
    """DeepSeek-V3 (section 2.1.2): independent affinities s = sigmoid(u . e), in fp32."""
    return logits.float().sigmoid()


def keep_all_groups(choice: Tensor) -> Tensor:
    return choice


def keep_top_groups(choice: Tensor, n_groups: int, topk_groups: int) -> Tensor:
    """DeepSeek-V3 node-limited routing: score each group of experts by the sum of its two best
    choice scores, keep the best ``topk_groups`` groups and hide every other expert.  (N, E) -> (N, E)"""
    grouped = choice.unflatten(-1, (n_groups, -1))  # (N, G, E/G)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(-1, group_score.topk(topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)  # (N, E)


def renormalize(weights: Tensor) -> Tensor:
    """The chosen weights sum to 1 (Mixtral; Qwen3-MoE norm_topk_prob; the 1e-20 is DeepSeek-V3's)."""
    return weights / (weights.sum(-1, keepdim=True) + 1e-20)


def keep_weights(weights: Tensor) -> Tensor:
    return weights


class Router(nn.Module):
    """scores = f(x W^T); experts = top-k of (scores + selection bias) inside the kept groups;
    weights = normalise(scores at those experts) * routed_scale. The bias only steers the choice."""

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        top_k: int,
        *,
        scores: Callable[[Tensor], Tensor],
        limit: Callable[[Tensor], Tensor],
        normalize: Callable[[Tensor], Tensor],
        scale: float,
        score_bias: bool,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        # DeepSeek-V3 e_score_correction_bias: updated outside backprop (aux-loss-free balancing).
        self.score_bias = nn.Buffer(torch.zeros(n_experts)) if score_bias else None
        self.top_k, self.scores, self.limit, self.normalize, self.scale = top_k, scores, limit, normalize, scale

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, D) -> (weights (N, k) fp32, experts (N, k) long, logits (N, E))."""
        logits = nn.functional.linear(x, self.weight)  # (N, E)
        scores = self.scores(logits)  # (N, E) fp32
        choice = scores if self.score_bias is None else scores + self.score_bias
        experts = self.limit(choice).topk(self.top_k, dim=-1).indices  # (N, k)
        weights = self.normalize(scores.gather(-1, experts)) * self.scale  # (N, k)
        return weights, experts, logits


def run_per_expert(ex: Experts, xs: Tensor, counts: Tensor) -> Tensor:
    """One matmul chain per expert over its contiguous slice of the sorted rows (n_e, D)."""
    # unbind, not gate[e]: one backward node stacks the E gradients, where E selects would each
    # fill a zero (E, F, D) gradient (measured: 19% of an MoE layer's fwd+bwd time).
    per_expert = zip(xs.split(counts.tolist()), ex.gate.unbind(0), ex.up.unbind(0), ex.down.unbind(0), strict=True)
    return torch.cat([ex.expert(*w) for w in per_expert if w[0].shape[0]])  # (N * k, D)


def run_grouped(ex: Experts, xs: Tensor, counts: Tensor) -> Tensor:
    """All experts in one grouped matmul per projection (torch.nn.functional.grouped_mm: no Python
    loop, no host sync; fp32 on CPU, bf16 on CUDA)."""
    offs = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert's slice
    h = ex.act(F.grouped_mm(xs, ex.gate.mT, offs=offs)) * F.grouped_mm(xs, ex.up.mT, offs=offs)  # (N * k, F)
    return F.grouped_mm(h, ex.down.mT, offs=offs)  # (N * k, D)


# (token, expert) pairs up to which a compiled graph runs each pair on its own expert's rows (a
# decode step of 8 rows at k = 8); past it every expert runs on every token (``Experts.static``).
STATIC_PAIRS = 64


class Experts(nn.Module):
    """E gated MLPs down(act(gate x) * up x) held as batched weights (E, F, D) / (E, D, F).
    ``run`` computes the sorted rows (``run_per_expert`` or ``run_grouped``, chosen at build)."""

    def __init__(
        self, n_experts: int, d_model: int, d_expert: int, act: Callable[[Tensor], Tensor], run: Callable | None = None
    ) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.up = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, d_expert))
        self.act = act
        self.run = run_per_expert if run is None else run

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """x (N, D), weights/experts (N, k) -> sum_j weights[:, j] * expert_{experts[:, j]}(x)  (N, D)."""
        if torch.compiler.is_compiling():  # a trace-time choice (nn/linear.py): eager never takes it
            return self.static(x, weights, experts)
        k = experts.shape[1]
        flat = experts.flatten()  # (N * k,) pair p = token p // k, its (p % k)-th choice
        order = flat.argsort(stable=True)  # pairs grouped by expert
        token = order // k  # (N * k,) the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.gate.shape[0])  # (E,) pairs per expert
        y = self.run(self, x[token], counts) * weights.flatten()[order, None].to(x.dtype)  # (N * k, D)
        return torch.zeros_like(x).index_add_(0, token, y)  # (N, D)

    def static(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """``forward`` in shapes that do not depend on the routing, for a compiled graph: grouping pairs
        by expert needs the count each expert got, a size dynamo cannot trace (a compiled MoE step
        failed with GuardOnDataDependentSymNode, either dispatch). Up to STATIC_PAIRS (token, expert)
        pairs (decode steps), each pair multiplies its expert's rows where they lie (the indexing
        inside the product, which inductor fuses into the product's loop instead of copying the
        rows out); more rows run every expert on every token, weighted by the routing weight
        (zero where not chosen: E / k times the products)."""
        N, k = experts.shape
        w = weights.to(x.dtype)
        if N * k <= STATIC_PAIRS:
            xs = x[:, None, None, :]  # (N, 1, 1, D)
            h = self.act((xs * self.gate[experts]).sum(-1)) * (xs * self.up[experts]).sum(-1)  # (N, k, F)
            y = (h[:, :, None, :] * self.down[experts]).sum(-1)  # (N, k, D)
            return (y * w[..., None]).sum(1)  # (N, D)
        dense = torch.zeros(N, self.gate.shape[0], dtype=x.dtype, device=x.device).scatter(1, experts, w)  # (N, E)
        h = self.act(torch.einsum("nd,efd->nef", x, self.gate)) * torch.einsum("nd,efd->nef", x, self.up)
        return torch.einsum("ne,nef,edf->nd", dense, h, self.down)  # (N, D)

    def expert(self, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
        """One expert on its tokens x (n, D) -> (n, D)."""
        h = self.act(x @ gate.T) * (x @ up.T)  # (n, F)
        return h @ down.T


class SharedExperts(nn.Module):
    """Always-on experts as one gated MLP (DeepSeekMoE shared experts), optionally scaled by
    sigmoid(gate x) per token (Qwen2-MoE shared_expert_gate)."""

    def __init__(self, mlp: nn.Module, d_model: int, gated: bool) -> None:
        super().__init__()
        self.mlp = mlp
        self.gate = Linear(d_model, 1, bias=False) if gated else None

    def forward(self, x: Tensor) -> Tensor:
        out = self.mlp(x)
        return out if self.gate is None else torch.sigmoid(self.gate(x)) * out


class RouterOutput(NamedTuple):
    logits: Tensor  # (N, E) router logits
    experts: Tensor  # (N, k) chosen experts


class MoEMLP(nn.Module):
    """y = sum over the token's chosen experts of weight * expert(x), plus the shared experts."""

    def __init__(self, router: Router, experts: Experts, shared: SharedExperts | None) -> None:
        super().__init__()
        self.router, self.experts, self.shared = router, experts, shared
        self.record: list[RouterOutput] | None = None  # set only inside record_routing

    def forward(self, x: Tensor) -> Tensor:
        flat = x.flatten(0, -2)  # (N, D)
        weights, experts, logits = self.router(flat)
        if self.record is not None:
            self.record.append(RouterOutput(logits, experts))
        out = self.experts(flat, weights, experts)  # (N, D)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)  # (B, T, D)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[list[RouterOutput]]:
    """``with record_routing(model) as routed: model(ids)``: one RouterOutput per MoE layer call,
    in call order. The list is the explicit channel; outside the block nothing is recorded."""
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    routed: list[RouterOutput] = []
    for m in layers:
        m.record = routed
    try:
        yield routed
    finally:
        for m in layers:
            m.record = None
