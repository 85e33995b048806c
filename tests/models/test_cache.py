"""Cached decoding == one full forward (< 1e-5 fp32): token by token, in chunks, and for a
left-padded batch; for DecoderLM and EncoderDecoder.decode, over the causal grid rows."""

import pytest
import torch

from .. import grid

CAUSAL = grid.variants(("decoder", "encoder_decoder"))
T, TOL = 11, 1e-5


def step_fn(model, batch, max_len, src=None, src_mask=None):
    """(cache, step(ids, positions, mask) -> logits) for either arch."""
    if model.config.arch == "decoder":
        cache = model.new_cache(batch, max_len)
        return lambda ids, pos, mask=None: model(ids, positions=pos, attention_mask=mask, cache=cache)
    memory = model.encode(src, src_mask=src_mask)
    cache = model.new_cache(batch, max_len, memory=memory, src_mask=src_mask)
    return lambda ids, pos, mask=None: model.decode(ids, positions=pos, attention_mask=mask, cache=cache)


def full_fn(model, src=None, src_mask=None):
    if model.config.arch == "decoder":
        return lambda ids, mask=None: model(ids, attention_mask=mask)
    return lambda ids, mask=None: model(src, ids, src_mask=src_mask, tgt_mask=mask)


def chunked(step, ids, sizes):
    outs, start = [], 0
    for size in sizes:
        outs.append(step(ids[:, start : start + size], torch.arange(start, start + size)))
        start += size
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("v", **grid.params(CAUSAL))
@torch.no_grad()
def test_cached_equals_full_forward(v):
    model = grid.build(v)
    ids = torch.randint(0, grid.VOCAB, (2, T))
    src = grid.source(2)
    src_mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])  # right-padded source
    full = full_fn(model, src, src_mask)(ids)
    for sizes in ([1] * T, [4, 1, 3, 3], [T]):
        out = chunked(step_fn(model, 2, 16, src, src_mask), ids, sizes)
        assert (out - full).abs().max().item() < TOL, f"chunks {sizes}"


@pytest.mark.parametrize("v", **grid.params(CAUSAL))
@torch.no_grad()
def test_left_padded_batch_cached_equals_full_and_unpadded(v):
    """Row 0 is 4 pads + 7 tokens. Prefill 8 columns with the mask and counted positions, then one
    token at a time with positions = previous + 1 (no mask): every real token's logits equal the
    full padded forward and the row run alone without padding."""
    model = grid.build(v)
    pad = 4
    ids = torch.randint(0, grid.VOCAB, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :pad] = 0
    src = grid.source(2)
    full = full_fn(model, src)(ids, mask)
    step = step_fn(model, 2, 16, src)
    prefill = 8
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    outs = [step(ids[:, :prefill], pos[:, :prefill], mask[:, :prefill])]
    for t in range(prefill, T):
        outs.append(step(ids[:, t : t + 1], pos[:, t : t + 1]))
    cached = torch.cat(outs, dim=1)
    real = mask.bool()
    assert (cached[real] - full[real]).abs().max().item() < TOL
    alone = full_fn(model, src[:1])(ids[:1, pad:])
    assert (full[0, pad:] - alone[0]).abs().max().item() < TOL
    assert not full.isnan().any() and not cached.isnan().any()


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("position", ["rope-half", "alibi", "learned"])
@torch.no_grad()
def test_sliding_window_cached_equals_full(backend, position):
    v = dict(grid.variants(("decoder",))[0], backend=backend, position=position)
    model = grid.build(v, attention={"sliding_window": 3})
    ids = torch.randint(0, grid.VOCAB, (2, T))
    full = model(ids)
    assert (chunked(step_fn(model, 2, 16), ids, [1] * T) - full).abs().max().item() < TOL
    assert (chunked(step_fn(model, 2, 16), ids, [5, 6]) - full).abs().max().item() < TOL
    # The window really limits attention: a token 3+ positions back does not reach the logits.
    changed = ids.clone()
    changed[:, 2] = (ids[:, 2] + 1) % grid.VOCAB
    diff = (model(changed) - full).abs()
    # 2 layers of window 3: position 2 reaches at most position 2 + 2 * 2 = 6.
    assert diff[:, 7:].max().item() == 0.0 and diff[:, 2:5].max().item() > 0


@torch.no_grad()
def test_cache_is_reused_after_reorder():
    """Beam-style: reorder the cache rows, then continue; equals running the selected rows."""
    v = grid.variants(("decoder",))[0]
    model = grid.build(v)
    ids = torch.randint(0, grid.VOCAB, (3, 6))
    cache = model.new_cache(3, 8)
    model(ids[:, :5], positions=torch.arange(5), cache=cache)
    cache.reorder(torch.tensor([2, 0]))
    last = model(ids[[2, 0], 5:6], positions=torch.tensor([5]), cache=cache)
    assert (last[:, 0] - model(ids[[2, 0]])[:, 5]).abs().max().item() < TOL
