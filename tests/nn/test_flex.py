"""The flex backend == the math reference (forward and gradients < 1e-5) over the variant grid and
every pattern: ALiBi, T5 buckets (both directions), windows, soft-cap, scale, padding, cached
decoding, chunked prefill. The rules' dense form == their element-wise (flex) evaluation.

Semantics run the eager FlexAttention kernel (no compile per shape); test_flex_compiled.py runs
the compiled one."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from torchformer.nn import flex, patterns
from torchformer.nn.backends import math_attention
from torchformer.nn.positions import ALiBiBias, RelativePositionBias

from .. import grid
from ..models.test_backend_parity import padding

TOL = 1e-5
ALL = grid.variants()


@pytest.fixture(autouse=True)
def _eager_flex():
    with flex.eager():
        yield


def loss_and_grads(model, ids, mask=None):
    model.zero_grad()
    out = grid.forward(model, ids, mask)
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b):
    (oa, ga), (ob, gb) = a, b
    assert (oa - ob).abs().max().item() < TOL
    assert set(ga) == set(gb)
    worst = max((ga[n] - gb[n]).abs().max().item() for n in ga)
    assert worst < TOL, worst


@pytest.mark.parametrize("v", **grid.params(ALL))
def test_flex_equals_math_forward_and_backward_on_the_grid(v):
    math_model = grid.build(dict(v, backend="math"))
    flex_model = grid.build(dict(v, backend="flex"))
    ids = torch.randint(0, grid.VOCAB, (2, 10))
    mask = padding(v["arch"], 2, 10)
    ref = loss_and_grads(math_model, ids, mask)
    assert_same(ref, loss_and_grads(flex_model, ids, mask))
    assert_same(loss_and_grads(math_model, ids), loss_and_grads(flex_model, ids))
    # The relative-bias table is learned: its gradient came back through flex's tiled backward.
    if v["position"] == "relative_bias":
        assert any("score_bias" in n for n in ref[1])


DECODER = grid.variants(("decoder",))[0]
CASES = {
    "alibi-window": dict(position="alibi", attention={"sliding_window": 5}),
    "relative-causal": dict(position="relative_bias"),
    "rope-window-softcap": dict(position="rope-half", attention={"sliding_window": 4, "softcap": 3.0}),
    "softcap-scale-gqa": dict(position="rope-interleaved", heads="gqa", attention={"softcap": 2.0, "scale": 0.7}),
    "scale-one-mqa": dict(position="relative_bias", heads="mqa", attention={"scale": 1.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flex_equals_math_on_each_pattern(case):
    changes = dict(CASES[case])
    v = dict(DECODER, position=changes.pop("position"), heads=changes.pop("heads", DECODER["heads"]))
    models = [grid.build(dict(v, backend=b), max_seq_len=160, **changes) for b in ("math", "flex", "sdpa")]
    ids = torch.randint(0, grid.VOCAB, (2, 150))  # > one 128 block: several tiles in the backward
    mask = padding("decoder", 2, 150)
    results = [loss_and_grads(m, ids, mask) for m in models]
    assert_same(results[0], results[1])
    assert_same(results[0], results[2])  # sdpa soft-caps through explicit scores


def test_bidirectional_relative_bias_encoder_with_right_padding():
    v = dict(grid.variants(("encoder",))[0], position="relative_bias", heads="gqa")
    math_model, flex_model = (grid.build(dict(v, backend=b), max_seq_len=160) for b in ("math", "flex"))
    ids = torch.randint(0, grid.VOCAB, (3, 140))
    mask = torch.ones(3, 140, dtype=torch.long)
    mask[0, 100:] = 0
    mask[2, 7:] = 0
    assert_same(loss_and_grads(math_model, ids, mask), loss_and_grads(flex_model, ids, mask))


@pytest.mark.parametrize("position", ["alibi", "relative_bias", "rope-half"])
@torch.no_grad()
def test_left_padded_cached_decoding_and_chunked_prefill(position):
    v = dict(DECODER, position=position)
    math_model = grid.build(dict(v, backend="math"), attention={"sliding_window": 6})
    flex_model = grid.build(dict(v, backend="flex"), attention={"sliding_window": 6})
    ids = torch.randint(0, grid.VOCAB, (2, 14))
    mask = padding("decoder", 2, 14)
    full = math_model(ids, attention_mask=mask)
    outs = []
    for model in (math_model, flex_model):
        cache = model.new_cache(2, 20)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        chunks = [model(ids[:, :5], positions=pos[:, :5], attention_mask=mask[:, :5], cache=cache)]
        chunks.append(model(ids[:, 5:9], positions=pos[:, 5:9], attention_mask=mask[:, 5:9], cache=cache))
        for t in range(9, 14):
            chunks.append(model(ids[:, t : t + 1], positions=pos[:, t : t + 1], cache=cache))
        outs.append(torch.cat(chunks, dim=1))
    real = mask.bool()
    assert (outs[0] - outs[1]).abs().max().item() < TOL
    assert (outs[1] - full)[real].abs().max().item() < TOL  # cached == the full forward on real tokens


def test_fully_masked_rows_give_zeros_and_gqa_shares_kv():
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    mask[0, :, 3] = False  # row 3 of batch 0 sees nothing
    out = flex.flex_attention(q, k, v, mask=mask, scale=0.3)
    assert torch.equal(out[0, :, 3], torch.zeros(4, 8))
    ref = math_attention(q, k, v, mask=mask, scale=0.3)
    assert (out - ref).abs().max().item() < TOL


def test_attention_dropout_in_training_is_the_references_dropout():
    """FlexAttention has no dropout: a training forward with attention dropout is math's, exactly."""
    v = dict(DECODER, position="alibi")
    a = grid.build(dict(v, backend="math"), attention={"dropout": 0.3}).train()
    b = grid.build(dict(v, backend="flex"), attention={"dropout": 0.3}).train()
    ids = torch.randint(0, grid.VOCAB, (2, 12))
    torch.manual_seed(5)
    ya = a(ids)
    torch.manual_seed(5)
    yb = b(ids)
    assert torch.equal(ya, yb)
    torch.manual_seed(6)
    assert not torch.equal(b(ids), yb)  # dropout is on


def index_eval(rule, B, H, T, S, mask_like: bool):
    """Evaluate a rule element by element, the way FlexAttention calls mask_mod/score_mod."""
    if mask_like:
        return create_mask(rule, B, 1, T, S, device="cpu")

    def at(b, h, q, kv):
        return rule(b, h, q, kv)

    f = at
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        f = torch.vmap(f, in_dims=dims)
    return f(torch.arange(B), torch.arange(H), torch.arange(T), torch.arange(S))


def test_each_rule_has_one_definition_dense_equals_elementwise_and_the_formula():
    B, H, T, S = 2, 4, 7, 11
    q_pos = torch.tensor([[4, 5, 6, 7, 8, 9, 10], [0, 0, 0, 1, 2, 3, 4]])
    k_pos = torch.arange(S)[None].expand(B, S).contiguous()
    valid = torch.rand(B, S) > 0.3
    docs = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3]] * B)
    qd = docs[:, 4:]
    rules = {
        "causal": (patterns.causal(q_pos, k_pos), k_pos[:, None, None, :] <= q_pos[:, None, :, None]),
        "window": (patterns.window(q_pos, k_pos, 3), (q_pos[:, None, :, None] - k_pos[:, None, None, :]) < 3),
        "padding": (patterns.key_valid(valid), valid[:, None, None, :].expand(B, 1, T, S)),
        "documents": (patterns.same_document(qd, docs), qd[:, None, :, None] == docs[:, None, None, :]),
    }
    for name, (rule, formula) in rules.items():
        dense = patterns.dense_mask(rule, B, T, S, "cpu")
        assert torch.equal(dense, formula.expand(B, 1, T, S)), name
        assert torch.equal(index_eval(rule, B, H, T, S, True), dense), name
    alibi = ALiBiBias(H)
    slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)])  # Press et al. 2022
    formula = -slopes.view(1, H, 1, 1) * (q_pos[:, None, :, None] - k_pos[:, None, None, :]).abs()
    assert torch.allclose(alibi(q_pos, k_pos), formula)
    assert torch.equal(index_eval(alibi.rule(q_pos, k_pos), B, H, T, S, False), alibi(q_pos, k_pos))
    for bidirectional in (False, True):
        rel = RelativePositionBias(H, 8, 20, bidirectional, max_len=16)
        torch.nn.init.normal_(rel.weight)
        buckets = rel.bucket(k_pos[:, None, :] - q_pos[:, :, None])  # (B, T, S), the bucket formula
        formula = rel.weight[buckets].permute(0, 3, 1, 2)
        assert torch.equal(rel(q_pos, k_pos), formula)
        assert torch.equal(index_eval(rel.rule(q_pos, k_pos), B, H, T, S, False), formula.detach())


@pytest.mark.parametrize("v", **grid.params(grid.variants(("encoder_decoder",))[:4]))
def test_flex_cross_attention_over_a_padded_source_equals_math(v):
    math_model, flex_model = grid.build(dict(v, backend="math")), grid.build(dict(v, backend="flex"))
    src, tgt = grid.source(2), torch.randint(0, grid.VOCAB, (2, 7))
    src_mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    results = []
    for model in (math_model, flex_model):
        model.zero_grad()
        out = model(src, tgt, src_mask=src_mask)
        (out**2).mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert_same(*results)


def test_on_cpu_the_kernel_runs_on_whole_blocks_and_the_padding_is_invisible(monkeypatch):
    """nn/flex.py pads CPU lengths to whole 128-blocks (torch 2.13's compiled CPU kernel was wrong
    below a block on AVX2): the kernel sees padded q / k / v, the caller T rows equal to math, with
    a padding mask and a bias the rules read at real positions only."""
    seen, real = [], flex.kernel

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(flex, "kernel", spy)
    q, k, v = torch.randn(2, 4, 40, 8), torch.randn(2, 2, 130, 8), torch.randn(2, 2, 130, 8)
    mask = torch.ones(2, 1, 40, 130, dtype=torch.bool)
    mask[1, :, :, 100:] = False  # batch 1's last keys are padding
    bias = torch.randn(1, 4, 40, 130)
    out = flex.flex_attention(q, k, v, mask=mask, bias=bias, scale=0.3)
    assert seen == [(128, 256)] and out.shape == (2, 4, 40, 8)
    assert (out - math_attention(q, k, v, mask=mask, bias=bias, scale=0.3)).abs().max().item() < TOL
