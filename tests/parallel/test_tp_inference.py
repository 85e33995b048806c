"""Issue 31: tensor parallelism at inference. Two ranks (gloo, CPU) give the single-process
model's logits within 1e-5 over the decoder grid (MHA, GQA; SwiGLU, GELU; tied and untied heads;
biases; learned positions), an encoder and an encoder-decoder, the same cached greedy tokens, and
each rank holds half of the split weights. The one torchrun launch of conftest.py measures
everything (tp_worker.py); the bad inputs are refused in-process, before any work."""

import pytest

import torchformer as tfm
from tests.decoding import assert_varied
from torchformer.parallel import check_tp, tp_plan

from .tp_worker import GRID, decoder

pytestmark = pytest.mark.xdist_group("parallel")


@pytest.fixture(scope="module")
def measured(launched):
    return launched["ranks"][0]


@pytest.mark.parametrize("name", list(GRID))
def test_two_ranks_give_the_single_process_logits(measured, name):
    assert measured[name]["max_diff"] <= 1e-5


@pytest.mark.parametrize("name", [n for n, c in GRID.items() if c.arch != "encoder"])
def test_cached_greedy_tokens_are_identical(measured, name):
    row = measured[name]
    assert_varied(row["ref_tokens"], 8)  # >= 8 distinct in 16: a degenerate sequence proves nothing
    assert row["tp_tokens"] == row["ref_tokens"]


@pytest.mark.parametrize("name", list(GRID))
def test_each_rank_holds_half_of_the_split_weights(measured, name):
    # The split weights: exactly half, up to the odd vocabulary's extra row (43 = 22 + 21).
    assert measured[name]["split_fraction"] == pytest.approx(0.5, abs=0.002)
    # All weights: norms and positions stay whole, a few percent at this width.
    assert 0.5 <= measured[name]["fraction"] <= 0.56


def test_training_logits_stay_split_into_the_loss(measured):
    row = measured["sharded-loss"]
    # A DTensor sharded on the vocabulary (S(2): Shard(dim=2)): rank 0 holds 22 of the 43 columns, never all.
    assert (row["logits_type"], row["placements"], row["local_vocab"]) == ("DTensor", ["S(2)"], 22)
    assert row["loss_diff"] <= 1e-5 and row["grad_diff"] <= 1e-5


@pytest.mark.parametrize(
    ("cfg", "tp", "match"),
    [
        (decoder(4, 4, "swiglu", True), 3, r"tp=3 does not divide attention.n_heads=4 \(heads=4, kv heads=4\)"),
        (decoder(4, 1, "swiglu", True), 2, r"tp=2 does not divide attention.n_kv_heads=1 \(heads=4, kv heads=1\)"),
        (decoder(2, 2, "gelu", True), 4, r"tp=4 does not divide attention.n_heads=2"),
        (decoder(4, 2, "swiglu", True), 0, r"tp=0: must be an integer >= 1"),
        (decoder(4, 2, "swiglu", True, positions=tfm.ALiBi()), 2, r"model.positions=ALiBi cannot be tensor-parallel"),
        (decoder(4, 2, "swiglu", True, moe=tfm.MoE(n_experts=4)), 2, r"model.moe \(mixture-of-experts\) cannot be"),
    ],
)
def test_what_cannot_be_split_is_refused(cfg, tp, match):
    with pytest.raises(ValueError, match=match):
        tp_plan(cfg, tp)


def test_tp_1_splits_nothing_and_refuses_nothing():
    check_tp(decoder(4, 1, "swiglu", True, positions=tfm.ALiBi()), 1)


def test_the_plan_is_one_table_for_every_family():
    plan = tp_plan(decoder(4, 2, "swiglu", False), 2)
    assert (plan.heads, plan.kv_heads) == (2, 1)
    assert set(plan.styles) == {
        "stack.blocks.*.attn.q_proj", "stack.blocks.*.attn.k_proj", "stack.blocks.*.attn.v_proj",
        "stack.blocks.*.attn.o_proj", "stack.blocks.*.mlp.gate", "stack.blocks.*.mlp.up", "stack.blocks.*.mlp.down",
        "embed.tok", "lm_head",
    }  # fmt: skip
    assert "stack.blocks.*.mlp.gate" not in tp_plan(decoder(4, 2, "gelu", False), 2).styles
