"""Without positions and without a causal mask, self-attention is permutation-equivariant."""

import pytest
import torch

from .. import grid

ENCODERS = grid.variants(("encoder",))[:12]


@pytest.mark.parametrize("v", **grid.params(ENCODERS))
@torch.no_grad()
def test_encoder_without_positions_is_permutation_equivariant(v):
    model = grid.build(dict(v, position="none"))
    ids = torch.randint(0, grid.VOCAB, (2, 10))
    perm = torch.randperm(10)
    out = model(ids)
    assert (model(ids[:, perm]) - out[:, perm]).abs().max().item() < 1e-5
    # With positions it is not (so the check can fail).
    positioned = grid.build(dict(v, position="learned"))
    assert (positioned(ids[:, perm]) - positioned(ids)[:, perm]).abs().max().item() > 1e-4


@pytest.mark.parametrize("v", **grid.params(grid.variants(("encoder_decoder",))[:6]))
@torch.no_grad()
def test_encoder_decoder_output_ignores_source_order_without_positions(v):
    """Encoder equivariant + cross-attention a set function => decoder logits invariant."""
    model = grid.build(dict(v, position="none"))
    src, tgt = grid.source(2), torch.randint(0, grid.VOCAB, (2, 6))
    perm = torch.randperm(src.shape[1])
    assert (model(src[:, perm], tgt) - model(src, tgt)).abs().max().item() < 1e-5
