"""Config words -> modules for expert MLPs and latent attention (configs/moe.py); build.py calls
these where a layer's MLP kind is "moe" or the model has ``mla``. Every choice is a table."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from ..configs import ModelConfig
from ..nn.latent_attention import LatentAttention
from ..nn.mlp import GatedMLP
from ..nn.moe import (
    Experts,
    MoEMLP,
    Router,
    SharedExperts,
    keep_all_groups,
    keep_top_groups,
    keep_weights,
    renormalize,
    run_grouped,
    run_per_expert,
    sigmoid_scores,
    softmax_scores,
)

ROUTER_SCORES = {"softmax": softmax_scores, "sigmoid": sigmoid_scores}  # moe.router -> scores
NORMALIZERS = {True: renormalize, False: keep_weights}  # moe.renormalize -> weights
DISPATCH = {"loop": run_per_expert, "grouped": run_grouped}  # moe.dispatch -> how experts run


def group_limit(n_groups: int, topk_groups: int) -> Callable[[Tensor], Tensor]:
    """One group (no limit) or DeepSeek-V3's best-groups mask."""
    return keep_all_groups if n_groups == 1 else partial(keep_top_groups, n_groups=n_groups, topk_groups=topk_groups)


def moe_mlp(cfg: ModelConfig, act: Callable[[Tensor], Tensor]) -> MoEMLP:
    """The expert MLP of a "moe" layer; experts and shared experts use the block's gated activation."""
    m, d = cfg.moe, cfg.d_model
    limit = group_limit(m.n_groups, m.topk_groups)
    router = Router(d, m.n_experts, m.top_k, scores=ROUTER_SCORES[m.router], limit=limit,
                    normalize=NORMALIZERS[m.renormalize], scale=m.routed_scale, score_bias=m.score_bias)  # fmt: skip
    experts = Experts(m.n_experts, d, m.expert_width(cfg.d_ff), act, DISPATCH[m.dispatch])
    shared = None
    if m.n_shared:
        shared = SharedExperts(GatedMLP(d, m.shared_width(cfg.d_ff), act, bias=False), d, m.shared_gate)
    return MoEMLP(router, experts, shared)


def latent_attention(cfg: ModelConfig, rotate: Callable | None, backend: Callable) -> LatentAttention:
    a, m = cfg.attention, cfg.mla
    return LatentAttention(
        cfg.d_model,
        a.n_heads,
        kv_rank=m.kv_rank,
        q_rank=m.q_rank,
        nope_dim=m.nope_dim,
        rope_dim=m.rope_dim,
        v_dim=m.v_dim,
        bias=a.bias,
        dropout=a.dropout,
        backend=backend,
        rotate=rotate,
        scale=m.qk_dim**-0.5 * m.mscale,
    )


@torch.no_grad()
def init_experts(model: nn.Module, std: float, depth_scale: float) -> None:
    """N(0, std) for the batched expert weights and routers (build.init_weights covers Linears);
    the down projections write into the residual stream, so they get the GPT-2 depth scale."""
    for module in model.modules():
        if isinstance(module, Experts) and not module.gate.is_meta:
            nn.init.normal_(module.gate, std=std)
            nn.init.normal_(module.up, std=std)
            nn.init.normal_(module.down, std=std * depth_scale)
        if isinstance(module, Router) and not module.weight.is_meta:
            nn.init.normal_(module.weight, std=std)
