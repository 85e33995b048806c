"""math == sdpa (< 1e-5) for every grid row: same weights, both backends, with and without
padding; an all-ones mask gives the same result as no mask (the mask path == the fast path)."""

import pytest
import torch

from .. import grid

ALL = grid.variants()
TOL = 1e-5


def both(v, **changes):
    return grid.build(dict(v, backend="math"), **changes), grid.build(dict(v, backend="sdpa"), **changes)


def padding(arch: str, batch: int, length: int) -> torch.Tensor:
    """Encoders pad on the right, decoders (generation) on the left."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if arch == "encoder":
        mask[0, -3:] = 0
    else:
        mask[0, :3] = 0
    return mask


@pytest.mark.parametrize("v", **grid.params(ALL))
@torch.no_grad()
def test_math_equals_sdpa(v):
    math_model, sdpa_model = both(v)
    ids = torch.randint(0, grid.VOCAB, (2, 10))
    mask = padding(v["arch"], 2, 10)
    ones = torch.ones_like(mask)
    ref = grid.forward(math_model, ids)
    assert (ref - grid.forward(sdpa_model, ids)).abs().max().item() < TOL
    padded = grid.forward(math_model, ids, mask)
    assert (padded - grid.forward(sdpa_model, ids, mask)).abs().max().item() < TOL
    for model in (math_model, sdpa_model):
        assert (grid.forward(model, ids, ones) - ref).abs().max().item() < TOL
    # Padding changed something (the check is not vacuous) and produced no NaN.
    assert (padded - ref).abs().max().item() > 1e-4 and not padded.isnan().any()


@pytest.mark.parametrize("v", **grid.params(grid.variants(("encoder_decoder",))[:6]))
@torch.no_grad()
def test_math_equals_sdpa_with_padded_source(v):
    math_model, sdpa_model = both(v)
    src, tgt = grid.source(2), torch.randint(0, grid.VOCAB, (2, 7))
    src_mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    a = math_model(src, tgt, src_mask=src_mask)
    b = sdpa_model(src, tgt, src_mask=src_mask)
    assert (a - b).abs().max().item() < TOL
    # Padded source keys are invisible: changing them changes nothing.
    src2 = src.clone()
    src2[1, 5:] = (src[1, 5:] + 1) % grid.VOCAB
    assert (math_model(src2, tgt, src_mask=src_mask) - a)[1].abs().max().item() < TOL


@pytest.mark.parametrize("position", ["rope-half", "alibi", "relative_bias", "none"])
@torch.no_grad()
def test_math_equals_sdpa_with_sliding_window(position):
    v = dict(grid.variants(("decoder",))[1], position=position)
    math_model, sdpa_model = both(v, attention={"sliding_window": 4})
    ids = torch.randint(0, grid.VOCAB, (2, 12))
    assert (math_model(ids) - sdpa_model(ids)).abs().max().item() < TOL
    mask = padding("decoder", 2, 12)
    assert (math_model(ids, attention_mask=mask) - sdpa_model(ids, attention_mask=mask)).abs().max().item() < TOL
