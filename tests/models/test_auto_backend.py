"""backend="auto": same outputs as math on every grid row, and the path it picks per situation
(plain causal -> sdpa is_causal, ALiBi / window -> flex with nothing dense, encoder padding ->
sdpa with a (B, 1, 1, S) mask, soft-cap -> flex, recorded -> math). Plus the bad inputs."""

import pytest
import torch

import torchformer as tfm
from torchformer.analysis import record_attention
from torchformer.models import build as build_module
from torchformer.nn import flex
from torchformer.nn.backends import math_attention, sdpa_attention

from .. import grid

TOL = 1e-5


@pytest.fixture(autouse=True)
def _eager_flex():
    with flex.eager():
        yield


@pytest.mark.parametrize("v", **grid.params(grid.variants()))
@torch.no_grad()
def test_auto_equals_math_on_the_grid(v):
    math_model, auto_model = grid.build(dict(v, backend="math")), grid.build(dict(v, backend="auto"))
    ids = torch.randint(0, grid.VOCAB, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    if v["arch"] == "encoder":
        mask = mask.flip(-1)  # encoders pad on the right
    for m in (None, mask):
        assert (grid.forward(math_model, ids, m) - grid.forward(auto_model, ids, m)).abs().max().item() < TOL


DECODER = grid.variants(("decoder",))[0]
POS = torch.arange(6)[None].expand(2, -1)


def context(position, arch="decoder", mask=None, **attention):
    model = grid.build(dict(DECODER, arch=arch, position=position, backend="auto"), attention=attention)
    return model.stack.context(POS, mask, None)


def test_auto_picks_sdpa_is_causal_for_plain_causal():
    ctx = context("rope-half")
    assert ctx.is_causal and ctx.pattern is None and ctx.mask is None and ctx.bias is None


def test_auto_picks_flex_for_alibi_and_windows_and_builds_nothing_dense():
    for ctx in (context("alibi"), context("relative_bias"), context("rope-half", sliding_window=3)):
        assert ctx.pattern.route is flex.flex_attention and ctx.pattern.blocks is not None
        assert ctx.mask is None and ctx.bias is None and ctx.pattern._dense is None


def test_auto_picks_sdpa_with_a_key_mask_for_encoder_padding():
    ctx = context("learned", arch="encoder", mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]))
    assert ctx.pattern.route is sdpa_attention and tuple(ctx.mask.shape) == (2, 1, 1, 6)


def test_auto_picks_flex_when_soft_capping_even_plain_causal():
    assert context("rope-half", softcap=5.0).pattern.route is flex.flex_attention


@torch.no_grad()
def test_recording_an_auto_or_flex_model_reads_weights_from_the_math_reference():
    for backend in ("auto", "flex"):
        v = dict(DECODER, position="alibi", backend=backend)
        model = grid.build(v, attention={"sliding_window": 4})
        ref = grid.build(dict(v, backend="math"), attention={"sliding_window": 4})
        ref.load_state_dict(model.state_dict())
        ids = torch.randint(0, grid.VOCAB, (2, 9))
        with record_attention(model) as rec:
            out = model(ids)
        assert (out - ref(ids)).abs().max().item() < TOL
        w = rec.weights["stack.blocks.0.attn"]
        assert tuple(w.shape) == (2, grid.N_HEADS, 9, 9)
        assert torch.allclose(w.sum(-1), torch.ones(2, grid.N_HEADS, 9))
        assert w[0, 0, 8, :5].abs().max().item() == 0.0  # outside the window: exactly zero
        # The recorder swapped in the math reference; the model's own backend is back afterwards.
        assert model.stack.blocks[0].attn.backend is build_module.BACKENDS[backend]


def test_verify_passes_on_a_flex_model():
    v = dict(DECODER, position="alibi", backend="flex")
    report = tfm.verify(grid.build(v), untrained=False, flop_budget=2e7)
    assert report.ok, report.table()


def test_without_flex_auto_warns_once_and_stays_dense_and_forced_flex_is_an_error(monkeypatch):
    monkeypatch.setattr(flex, "unavailable_reason", lambda device=None: "no C++ compiler found")
    v = dict(DECODER, position="alibi")
    with pytest.warns(UserWarning, match="no C.. compiler found"):
        model = grid.build(dict(v, backend="auto"))
    ctx = model.stack.context(POS, None, None)
    assert ctx.pattern.route is sdpa_attention and ctx.bias is not None
    with pytest.raises(ValueError, match="attention.backend='flex' cannot run here: no C.. compiler"):
        grid.build(dict(v, backend="flex"))
    soft = grid.build(dict(v, backend="auto"), attention={"softcap": 3.0}).stack.context(POS, None, None)
    assert soft.pattern.route is math_attention


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"backend": "fast"}, "attention.backend='fast'"),
        ({"softcap": 0.0}, "attention.softcap=0.0"),
        ({"softcap": -5}, "attention.softcap=-5"),
        ({"scale": 0}, "attention.scale=0"),
        ({"scale": float("inf")}, "attention.scale=inf"),
    ],
)
def test_bad_attention_fields_are_clear_errors(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("'", "'")):
        tfm.AttentionConfig(n_heads=4, **changes)


@torch.no_grad()
def test_generation_over_the_static_cache_with_flex_and_auto_equals_math():
    v = dict(DECODER, position="alibi")
    ids = torch.randint(0, grid.VOCAB, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    outs = [
        tfm.generate(
            grid.build(dict(v, backend=b), attention={"sliding_window": 5}), ids, attention_mask=mask, max_new_tokens=6
        )  # fmt: skip
        for b in ("math", "flex", "auto")
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
