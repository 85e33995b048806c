"""MoE training: the balancing and z losses against hand computations and transformers' own
load_balancing_loss_func; a tiny MoE trains on the default Shakespeare data, its validation loss
falls, the router losses are logged and every expert receives tokens."""

import math

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from torchformer.nn.moe import RouterOutput, record_routing
from torchformer.training import recipe
from torchformer.training.losses import load_balancing_loss, router_z_loss
from torchformer.training.report import Reporter
from torchformer.training.train import train


def hand_balance(logits, experts):
    """E * sum_e f_e P_e with plain loops (Switch eq. 4; f_e counts a token once per top-k slot)."""
    N, E = logits.shape
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.tolist()]
    f = [sum(e in row for row in experts.tolist()) / N for e in range(E)]
    P = [sum(p[e] for p in probs) / N for e in range(E)]
    return E * sum(fe * pe for fe, pe in zip(f, P, strict=True))


@pytest.mark.parametrize(("E", "k"), [(4, 1), (8, 2), (6, 3)])
def test_balance_loss_equals_hand_computation_and_transformers(E, k):
    logits = torch.randn(30, E)
    experts = logits.topk(k, -1).indices
    routed = [RouterOutput(logits, experts)]
    torch.testing.assert_close(load_balancing_loss(routed).double(), torch.tensor(hand_balance(logits, experts),
                               dtype=torch.float64), atol=1e-6, rtol=1e-6)  # fmt: skip
    # transformers (Mixtral): the same formula for one layer, top-k taken from softmax(logits)
    theirs = load_balancing_loss_func((logits,), E, k)
    torch.testing.assert_close(load_balancing_loss(routed), theirs.float(), atol=1e-6, rtol=1e-6)


def test_balance_loss_is_k_when_uniform_and_layers_average():
    E, k = 4, 2
    uniform = RouterOutput(torch.zeros(8, E), torch.tensor([[0, 1], [2, 3]] * 4))  # each expert 4 of 8 tokens
    assert load_balancing_loss([uniform]).item() == pytest.approx(k)
    skewed = RouterOutput(torch.zeros(8, E), torch.tensor([[0, 1]] * 8))
    both = load_balancing_loss([uniform, skewed]).item()
    assert both == pytest.approx((load_balancing_loss([uniform]) + load_balancing_loss([skewed])).item() / 2)


def test_z_loss_equals_hand_computation():
    a, b = torch.randn(5, 4), torch.randn(7, 4)
    hand = [sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in t.tolist()) / len(t) for t in (a, b)]
    got = router_z_loss([RouterOutput(a, a.topk(1).indices), RouterOutput(b, b.topk(1).indices)])
    assert got.item() == pytest.approx(sum(hand) / 2, rel=1e-5)


class Rows(Reporter):
    def __init__(self):
        self.rows = []

    def step(self, info):
        self.rows.append(info)


def test_tiny_moe_trains_on_shakespeare_and_uses_every_expert(tmp_path):
    moe = "model.moe={n_experts: 4, top_k: 2, d_expert: 64}"
    overrides = ["model.d_model=32", "model.n_layers=2", "model.attention.n_heads=2", "model.block.mlp=swiglu",
                 "model.block.bias=false", "model.block.norm=rmsnorm", moe, "train.steps=60", "train.eval_every=60",
                 "train.eval_batches=4", "train.log_every=10", "train.batch_size=16", "train.device=cpu",
                 "train.max_time_s=null", "train.moe_z_loss=0.001", "train.sample_chars=0",
                 f"train.out_dir={tmp_path / 'run'}"]  # fmt: skip
    rows = Rows()
    result = train(recipe.load("shakespeare-char", overrides), reporter=rows)
    first, last = result.metrics[0]["val_loss"], result.metrics[-1]["val_loss"]
    assert last < first - 0.3, (first, last)
    assert rows.rows and all("balance_loss" in r and "z_loss" in r for r in rows.rows)  # logged every log step
    assert all(0.9 <= r["balance_loss"] <= 4.0 for r in rows.rows)  # k=2 when balanced, E*k at worst
    ids = torch.randint(0, result.model.config.vocab_size, (8, 64))
    with torch.no_grad(), record_routing(result.model) as routed:
        result.model(ids)
    assert len(routed) == 2
    for layer in routed:
        counts = torch.bincount(layer.experts.flatten(), minlength=4)
        assert (counts > 0).all(), counts
