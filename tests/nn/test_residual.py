"""Parallel residual wirings: a built block equals the formula x + attn(norm1 x) [+ cross(normc x)]
+ mlp(norm2 x) written out from its own modules, and the shared-norm form equals the two-norm
form whose later norms carry the first norm's weights. Cached == full for these rows runs in
tests/models/test_cache.py through the grid's placement axis."""

from __future__ import annotations

import pytest
import torch

from .. import grid

ROWS = [
    dict(grid.variants((arch,))[0], placement=placement)
    for arch in ("decoder", "encoder_decoder")
    for placement in ("parallel", "parallel_shared")
]


def _context_and_memory(model, ids):
    """The self-attention context of the first decoder stack, and cross K/V where there is one."""
    pos = torch.arange(ids.shape[1])[None, :].expand(ids.shape[0], -1)
    if model.config.arch == "decoder":
        return model.stack, model.embed(ids, pos), model.stack.context(pos, None, None), None, None
    from torchformer.models.stack import cross_context

    memory = model.encode(grid.source(ids.shape[0]))
    kv = model.cross_kv(memory)
    return model.decoder, model.tgt_embed(ids, pos), model.decoder.context(pos, None, None), kv, cross_context(None)


@pytest.mark.parametrize("v", **grid.params(ROWS))
@torch.no_grad()
def test_parallel_block_is_the_formula(v):
    model = grid.build(v)
    torch.manual_seed(3)
    for p in model.parameters():  # norms away from 1 so shared and separate norms differ
        p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, grid.VOCAB, (2, 7))
    stack, x, ctx, kv, cross_ctx = _context_and_memory(model, ids)
    blk = stack.blocks[0]
    shared = v["placement"] == "parallel_shared"
    n_attn = blk.attn_norm
    n_mlp = n_attn if shared else blk.mlp_norm
    want = x + blk.attn(n_attn(x), ctx) + blk.mlp(n_mlp(x))
    if kv is not None:
        n_cross = n_attn if shared else blk.cross_norm
        want = want + blk.cross_attn.cross(n_cross(x), kv[0], cross_ctx)
    got = blk(x, ctx, None, None if kv is None else kv[0], cross_ctx)
    assert (got - want).abs().max() < 1e-5
    if kv is None:  # and it is not the sequential pre-norm block in disguise
        seq = x + blk.attn(n_attn(x), ctx)
        assert (got - (seq + blk.mlp(n_mlp(seq)))).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
@torch.no_grad()
def test_shared_norm_equals_two_norms_with_equal_weights(arch):
    v = dict(grid.variants((arch,))[1], placement="parallel", norm="layernorm")
    two = grid.build(v)
    shared = grid.build(dict(v, placement="parallel_shared"))
    state = two.state_dict()
    for name, t in list(state.items()):  # later norms := the block's first norm
        for later in ("mlp_norm", "cross_norm"):
            if f".{later}." in name:
                t.copy_(state[name.replace(later, "attn_norm")] + 0.0)
    two.load_state_dict(state)
    missing, unexpected = shared.load_state_dict(state, strict=False)
    assert not missing and all(".mlp_norm." in n or ".cross_norm." in n for n in unexpected) and unexpected
    ids = torch.randint(0, grid.VOCAB, (2, 9))
    assert (grid.forward(two, ids) - grid.forward(shared, ids)).abs().max() < 1e-5
    # The shared form holds no later norms: one (weight, bias) pair fewer per later sublayer.
    later_sublayers = {"decoder": 1, "encoder": 1, "encoder_decoder": 1 + 2}[arch]
    n_two, n_shared = (sum(p.numel() for p in m.parameters()) for m in (two, shared))
    assert n_two - n_shared == later_sublayers * grid.N_LAYERS * 2 * grid.D_MODEL
