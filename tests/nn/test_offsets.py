"""The offsets path (nn/offsets.py: fused CPU flash kernel per query chunk, bias as a strided view
of one vector per head) == the math reference, forward and gradients < 1e-5, over the variant grid
and over patterns that exercise its parts: several chunks, GQA groups, windows, T5 tables whose
far buckets (beyond max_distance, on one side or both) get their gradient from the row-sum
identity and the restricted forward. Plus: auto routes aligned contexts there and nothing else."""

import dataclasses

import pytest
import torch

import torchformer as tfm
from torchformer.nn import flex, offsets
from torchformer.nn.backends import math_attention
from torchformer.nn.patterns import Pattern, all_of, causal, window
from torchformer.nn.positions import ALiBiBias, RelativePositionBias

from .. import grid
from .test_flex import assert_same, loss_and_grads


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(offsets, "CHUNK", 4)  # a 10-token grid row spans three chunks


@pytest.mark.parametrize("v", **grid.params(grid.variants()))
def test_auto_offsets_path_equals_math_forward_and_backward_on_the_grid(v, small_chunks):
    math_model, auto_model = grid.build(dict(v, backend="math")), grid.build(dict(v, backend="auto"))
    ids = torch.randint(0, grid.VOCAB, (2, 10))
    ref = loss_and_grads(math_model, ids)
    assert_same(ref, loss_and_grads(auto_model, ids))
    if v["position"] == "relative_bias":  # the learned table's gradient came back through bias_grad
        assert any("score_bias" in n for n in ref[1])


def pattern(T, H, *, bidirectional=False, size=None, bias=None, reach=None, params=()):
    pos = torch.arange(T)[None]
    rules = [None if bidirectional else causal(pos, pos), None if size is None else window(pos, pos, size)]
    return Pattern(all_of(rules), bias, 1, H, T, T, torch.device("cpu"), aligned=True, reach=reach, params=params)


def alibi(T, H):
    pos = torch.arange(T)[None]
    return ALiBiBias(H).rule(pos, pos)


def relative(T, H, bidirectional, max_distance):
    table = RelativePositionBias(H, num_buckets=8, max_distance=max_distance, bidirectional=bidirectional, max_len=T)
    torch.nn.init.normal_(table.weight, std=1.0)
    pos = torch.arange(T)[None]
    return table, table.rule(pos, pos)


def compare(p: Pattern, K: int, E: int = 8, B: int = 2, params=()):
    """offset_attention == math_attention on the dense pattern: output and every gradient."""
    torch.manual_seed(0)
    q = torch.randn(B, p.H, p.T, E, requires_grad=True)
    k, v = (torch.randn(B, K, p.T, E, requires_grad=True) for _ in range(2))
    dout = torch.randn(B, p.H, p.T, E)
    results = []
    for run in ("offsets", "math"):
        for t in (q, k, v, *params):
            t.grad = None
        if run == "offsets":
            p = dataclasses.replace(p, offsets=offsets.offset_vector(p))  # a frozen Pattern: no dense form yet
            out = offsets.offset_attention(q, k, v, scale=E**-0.5, pattern=p)
        else:
            mask, bias = p.dense()
            out = math_attention(q, k, v, mask=mask, bias=bias, scale=E**-0.5)
        out.backward(dout)
        results.append([out.detach()] + [t.grad.clone() for t in (q, k, v, *params)])
    for a, b in zip(*results):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("K", [4, 2, 1])
@pytest.mark.parametrize("size", [None, 5])
def test_alibi_causal_and_windowed_over_chunks_and_gqa_groups(small_chunks, K, size):
    compare(pattern(23, 4, size=size, bias=alibi(23, 4)), K)


def test_alibi_bidirectional_and_plain_window(small_chunks):
    compare(pattern(19, 4, bidirectional=True, bias=alibi(19, 4)), 2)
    compare(pattern(19, 4, size=3), 4)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("max_distance", [6, 40])  # far buckets present / every offset exact
@pytest.mark.parametrize("K", [4, 2])
def test_relative_bias_table_gradient(small_chunks, bidirectional, max_distance, K):
    T, H = 29, 4
    table, rule = relative(T, H, bidirectional, max_distance)
    p = pattern(T, H, bidirectional=bidirectional, bias=rule, reach=table.reach, params=table.params)
    compare(p, K, params=table.params)


def test_relative_bias_windowed_table_gradient(small_chunks):
    T, H = 31, 2
    table, rule = relative(T, H, False, 8)
    compare(pattern(T, H, size=12, bias=rule, reach=table.reach, params=table.params), 2, params=table.params)


def test_one_chunk_at_the_default_size():
    T, H = 70, 4
    table, rule = relative(T, H, True, 10)
    p = pattern(T, H, bidirectional=True, bias=rule, reach=table.reach, params=table.params)
    compare(p, 4, params=table.params)


def context(position, *, aligned, arch="decoder", mask=None, **attention):
    v = dict(grid.variants(("decoder",))[0], arch=arch, position=position, backend="auto")
    model = grid.build(v, attention=attention)
    return model.stack.context(torch.arange(6)[None].expand(2, -1), mask, None, aligned=aligned)


def test_auto_routes_aligned_contexts_to_offsets_and_the_rest_elsewhere():
    with flex.eager():
        for ctx in (context("alibi", aligned=True), context("relative_bias", aligned=True),
                    context("rope-half", aligned=True, sliding_window=3)):  # fmt: skip
            assert ctx.pattern.route is offsets.offset_attention and ctx.pattern.offsets is not None
            assert ctx.pattern.blocks is None and ctx.pattern._dense is None  # nothing else built
        # not aligned (explicit positions), soft-capped, or padded: not this path
        for ctx in (context("alibi", aligned=False), context("alibi", aligned=True, softcap=3.0),
                    context("alibi", aligned=True, mask=torch.tensor([[1] * 6, [0] * 2 + [1] * 4]))):  # fmt: skip
            assert ctx.pattern.route is not offsets.offset_attention
        assert context("rope-half", aligned=True).pattern is None  # plain causal: SDPA is_causal


@torch.no_grad()
def test_a_forward_with_explicit_positions_takes_the_general_path_and_agrees():
    v = dict(grid.variants(("decoder",))[0], position="alibi")
    math_model, auto_model = grid.build(dict(v, backend="math")), grid.build(dict(v, backend="auto"))
    ids = torch.randint(0, grid.VOCAB, (2, 10))
    shifted = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 10])  # a gap: not a function of kv - q alone
    with flex.eager():
        assert (math_model(ids, positions=shifted) - auto_model(ids, positions=shifted)).abs().max() < 1e-5
    assert (math_model(ids) - auto_model(ids)).abs().max() < 1e-5


def test_dropout_in_training_falls_back_to_the_reference_dropout():
    v = dict(grid.variants(("decoder",))[0], position="alibi", backend="auto")
    model = grid.build(v, attention={"dropout": 0.5}).train()
    ids = torch.randint(0, grid.VOCAB, (1, 8))
    torch.manual_seed(3)
    a = model(ids)
    torch.manual_seed(3)
    assert torch.equal(a, model(ids))  # seeded dropout: reproducible
    assert not torch.equal(a, model.eval()(ids))  # and really applied in training


def test_one_offset_vector_per_forward_shared_by_every_layer(monkeypatch):
    import torchformer.nn.routing as routing

    cfg = tfm.ModelConfig(vocab_size=20, d_model=32, n_layers=3, max_seq_len=64,
                          attention=tfm.AttentionConfig(n_heads=4, backend="auto"), positions=tfm.ALiBi())  # fmt: skip
    model, calls, real = tfm.build_model(cfg), [], offsets.offset_vector
    monkeypatch.setattr(routing, "offset_vector", lambda p: calls.append(p) or real(p))
    model(torch.randint(0, 20, (1, 12)))
    assert len(calls) == 1
