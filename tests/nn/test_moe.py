"""The expert MLP: sorted dispatch == a naive per-token loop, every router variant against a hand
computation written here from the papers' formulas, shared experts, recording."""

import itertools
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from torchformer.nn.mlp import GatedMLP
from torchformer.nn.moe import (
    Experts,
    MoEMLP,
    Router,
    SharedExperts,
    keep_all_groups,
    keep_top_groups,
    keep_weights,
    record_routing,
    renormalize,
    run_grouped,
    run_per_expert,
    sigmoid_scores,
    softmax_scores,
)

D, E, F_ = 12, 8, 16


def experts_filled(n=E, d=D, f=F_, run=None):
    ex = Experts(n, d, f, F.silu, run)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return ex


def router(top_k=2, scores=softmax_scores, normalize=renormalize, scale=1.0, bias=False, groups=None):
    limit = keep_all_groups if groups is None else partial(keep_top_groups, n_groups=groups[0], topk_groups=groups[1])
    r = Router(D, E, top_k, scores=scores, limit=limit, normalize=normalize, scale=scale, score_bias=bias)
    torch.nn.init.normal_(r.weight, std=0.5)
    if bias:
        r.score_bias.normal_(std=0.3)
    return r


def naive_experts(ex, x, weights, experts):
    """One token at a time, one chosen expert at a time: the definition of the MoE sum."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            h = F.silu(ex.gate[e] @ x[n]) * (ex.up[e] @ x[n])
            out[n] += weights[n, j] * (ex.down[e] @ h)
    return out


RUNS = {"loop": run_per_expert, "grouped": run_grouped}


@pytest.mark.parametrize(("n_tokens", "top_k", "run"), list(itertools.product([1, 7, 33, 64], [1, 2, 8], RUNS)))
def test_dispatch_equals_per_token_loop(n_tokens, top_k, run):
    ex = experts_filled(run=RUNS[run])
    x = torch.randn(n_tokens, D)
    experts = torch.stack([torch.randperm(E)[:top_k] for _ in range(n_tokens)])  # distinct per token
    weights = torch.rand(n_tokens, top_k)
    torch.testing.assert_close(ex(x, weights, experts), naive_experts(ex, x, weights, experts), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("run", list(RUNS))
def test_dispatch_with_unused_experts_and_gradients(run):
    """Experts no token chose are skipped; gradients equal the naive loop's."""
    ex = experts_filled(run=RUNS[run])
    x = torch.randn(10, D, requires_grad=True)
    experts = torch.randint(0, 3, (10, 1))  # only experts 0..2 used
    weights = torch.rand(10, 1)
    ex(x, weights, experts).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in ex.parameters()]
    x.grad = None
    ex.zero_grad()
    naive_experts(ex, x, weights, experts).square().sum().backward()
    want = [x.grad] + [p.grad for p in ex.parameters()]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert ex.gate.grad[3:].abs().max() == 0  # unused experts get no gradient


def hand_route(w, x, top_k, kind, norm, scale, bias=None, groups=None):
    """Routing written out per token with Python lists (Mixtral eq. 1-2; DeepSeek-V3 eq. 12-16)."""
    logits = (x.double() @ w.double().T).tolist()
    all_w, all_e = [], []
    for row in logits:
        if kind == "softmax":
            m = max(row)
            z = sum(math.exp(v - m) for v in row)
            s = [math.exp(v - m) / z for v in row]
        else:
            s = [1 / (1 + math.exp(-v)) for v in row]
        c = [si + (0.0 if bias is None else float(bias[i])) for i, si in enumerate(s)]
        allowed = set(range(E))
        if groups is not None:
            g, keep = groups
            size = E // g
            gscore = [sum(sorted(c[i * size : (i + 1) * size], reverse=True)[:2]) for i in range(g)]
            best = sorted(range(g), key=lambda i: -gscore[i])[:keep]
            allowed = {i * size + j for i in best for j in range(size)}
        chosen = sorted(allowed, key=lambda i: -c[i])[:top_k]
        ws = [s[i] for i in chosen]
        if norm:
            ws = [v / sum(ws) for v in ws]
        all_w.append([v * scale for v in ws])
        all_e.append(chosen)
    return torch.tensor(all_w), torch.tensor(all_e)


ROUTERS = {
    "mixtral": dict(kind="softmax", norm=True, scale=1.0),
    "qwen-no-norm": dict(kind="softmax", norm=False, scale=1.0),
    "sigmoid-norm-scaled": dict(kind="sigmoid", norm=True, scale=2.5),
    "deepseek-v3": dict(kind="sigmoid", norm=True, scale=2.5, bias=True, groups=(4, 2)),
    "sigmoid-groups-no-norm": dict(kind="sigmoid", norm=False, scale=1.0, groups=(2, 1)),
}


@pytest.mark.parametrize(("name", "top_k"), list(itertools.product(ROUTERS, [1, 2, 3])))
def test_router_against_hand_computation(name, top_k):
    v = ROUTERS[name]
    scores = {"softmax": softmax_scores, "sigmoid": sigmoid_scores}[v["kind"]]
    norm = renormalize if v["norm"] else keep_weights
    r = router(top_k, scores, norm, v["scale"], v.get("bias", False), v.get("groups"))
    x = torch.randn(40, D)
    weights, experts, logits = r(x)
    want_w, want_e = hand_route(r.weight, x, top_k, v["kind"], v["norm"], v["scale"], r.score_bias, v.get("groups"))
    order = experts.sort(-1).indices  # topk order is not part of the definition
    assert torch.equal(experts.gather(-1, order), want_e.sort(-1).values)
    want_sorted = want_w.gather(-1, want_e.sort(-1).indices).float()
    torch.testing.assert_close(weights.gather(-1, order), want_sorted, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits, x @ r.weight.T)


def test_selection_bias_steers_choice_not_weights():
    """A large bias on expert 5 makes every token pick it, weighted by its unbiased score."""
    r = router(2, sigmoid_scores, keep_weights, 1.0, bias=True)
    r.score_bias.zero_()
    r.score_bias[5] = 10.0
    x = torch.randn(16, D)
    weights, experts, _ = r(x)
    assert (experts == 5).any(-1).all()
    at5 = weights[experts == 5]
    torch.testing.assert_close(at5, torch.sigmoid(x @ r.weight[5]))


def test_group_limit_keeps_only_best_groups():
    choice = torch.tensor([[0.9, 0.8, 0.1, 0.1, 0.5, 0.45, 0.95, 0.0]])  # groups of 2: sums 1.7, .2, .95, .95
    out = keep_top_groups(choice, n_groups=4, topk_groups=1)
    assert torch.isinf(out[0, 2:]).all() and torch.equal(out[0, :2], choice[0, :2])


@pytest.mark.parametrize("gated", [False, True])
def test_moe_mlp_sum_with_shared_experts(gated):
    r, ex = router(2), experts_filled()
    shared_mlp = GatedMLP(D, 24, F.silu, bias=False)
    shared = SharedExperts(shared_mlp, D, gated)
    if gated:
        torch.nn.init.normal_(shared.gate.weight)
    moe = MoEMLP(r, ex, shared)
    x = torch.randn(3, 5, D)
    flat = x.reshape(15, D)
    weights, experts, _ = r(flat)
    gate = torch.sigmoid(flat @ shared.gate.weight.T) if gated else 1.0
    want = naive_experts(ex, flat, weights, experts) + gate * shared_mlp(flat)
    torch.testing.assert_close(moe(x), want.reshape(3, 5, D), atol=1e-5, rtol=1e-5)


def test_record_routing_is_scoped():
    moe = MoEMLP(router(2), experts_filled(), None)
    x = torch.randn(2, 4, D)
    with record_routing(moe) as routed:
        moe(x)
        moe(x)
    moe(x)  # outside the block: not recorded
    assert len(routed) == 2 and moe.record is None
    assert routed[0].logits.shape == (8, E) and routed[0].experts.shape == (8, 2)


@pytest.mark.parametrize(("n_tokens", "top_k", "run"), list(itertools.product([1, 8, 33], [1, 2, 8], RUNS)))
def test_compiled_dispatch_equals_per_token_loop(n_tokens, top_k, run, aot_eager):
    """Under torch.compile (dynamo's graph; aot_eager runs it) the experts take shapes the routing
    cannot change (``Experts.static``): each pair on its expert's rows up to STATIC_PAIRS pairs
    (1 x 1 ... 8 x 8), every expert weighted past it (33 x 2, 33 x 8). A graph per case proves the
    compiled path ran (the sorted dispatch cannot be traced: data-dependent counts)."""
    ex = experts_filled(run=RUNS[run])
    x = torch.randn(n_tokens, D)
    experts = torch.stack([torch.randperm(E)[:top_k] for _ in range(n_tokens)])
    weights = torch.rand(n_tokens, top_k)
    got = torch.compile(ex, fullgraph=True)(x, weights, experts)
    assert len(aot_eager) == 1
    torch.testing.assert_close(got, naive_experts(ex, x, weights, experts), atol=1e-5, rtol=1e-5)
