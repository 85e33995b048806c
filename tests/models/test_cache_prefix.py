"""A cached step on the CPU attends over only the live prefix of the static cache (nn/backends.py,
``prefix_sdpa``): slots past the highest query position are never read. Proved by poisoning
them: every slot of the cache starts as NaN, so a step that read a dead slot (even one masked to
weight 0: NaN * 0 = NaN) would return NaN; the poisoned cached run equals the full forward."""

import pytest
import torch

from torchformer.nn import backends

from .. import grid
from .test_cache import TOL, T, chunked, full_fn, step_fn

SDPA_ROWS = [v for v in grid.variants(("decoder", "encoder_decoder")) if v["backend"] == "sdpa"]


def poison(cache) -> None:
    for layer in cache.layers:
        layer.k.fill_(float("nan"))
        layer.v.fill_(float("nan"))


@pytest.mark.parametrize("v", **grid.params(SDPA_ROWS))
@torch.inference_mode()
def test_poisoned_dead_slots_are_never_read(v, monkeypatch):
    model = grid.build(v)
    ids = torch.randint(0, grid.VOCAB, (2, T))
    src = grid.source(2)
    src_mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    full = full_fn(model, src, src_mask)(ids)
    caches = []
    new_cache = model.new_cache

    def poisoned_cache(*args, **kwargs):
        cache = new_cache(*args, **kwargs)
        poison(cache)
        caches.append(cache)
        return cache

    monkeypatch.setattr(model, "new_cache", poisoned_cache)
    for sizes in ([1] * T, [4, 1, 6]):
        out = chunked(step_fn(model, 2, 16, src, src_mask), ids, sizes)
        assert torch.isfinite(out).all(), f"chunks {sizes}: a dead (NaN) slot was read"
        assert (out - full).abs().max().item() < TOL, f"chunks {sizes}"
    assert caches and torch.isnan(caches[-1].layers[0].k[:, :, T:]).all()  # the dead slots were poisoned


@torch.no_grad()
def test_the_cached_context_counts_the_live_slots():
    model = grid.build(next(v for v in SDPA_ROWS if v["arch"] == "decoder"))
    pos = torch.tensor([[3], [7]])
    cached = model.stack.context(pos, None, model.new_cache(2, 16)).pattern
    assert int(cached.live) == 8  # slots 0..7: the highest query sees its own slot 7
    uncached = model.stack.context(torch.arange(5)[None].expand(2, -1), None, None).pattern
    assert uncached is None or uncached.live is None


def test_with_autograd_the_cached_step_reads_the_whole_cache():
    """The custom op has no backward: under autograd a cached step keeps the dense SDPA."""
    q = torch.zeros(1, 8, 1, 64)
    assert not backends.prefix_applies(q, False, 0.0)
    with torch.no_grad():
        assert backends.prefix_applies(q, False, 0.0)
        assert not backends.prefix_applies(q, True, 0.0) and not backends.prefix_applies(q, False, 0.1)
