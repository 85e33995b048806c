"""Masks built from positions, and the static KV cache."""

import torch

from torchformer.nn.kv_cache import KVCache
from torchformer.nn.masks import causal_mask, combine, padding_mask, window_mask


def test_causal_mask_from_positions():
    pos = torch.arange(4)[None]
    assert torch.equal(causal_mask(pos, pos)[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    # A chunk of queries at positions 2, 3 over 5 cache slots: bottom-right aligned, not top-left.
    chunk = causal_mask(torch.tensor([[2, 3]]), torch.arange(5)[None])[0, 0]
    assert chunk.tolist() == [[True, True, True, False, False], [True, True, True, True, False]]


def test_window_and_padding_and_combine():
    pos = torch.arange(5)[None]
    w = window_mask(pos, pos, 2)[0, 0] & causal_mask(pos, pos)[0, 0]
    assert w.sum(-1).tolist() == [1, 2, 2, 2, 2]
    assert w[4].tolist() == [False, False, False, True, True]
    pad = padding_mask(torch.tensor([[0, 1, 1]]))
    assert pad.shape == (1, 1, 1, 3) and pad[0, 0, 0].tolist() == [False, True, True]
    assert combine(None, None) is None
    assert torch.equal(combine(None, pad), pad)
    assert torch.equal(combine(causal_mask(pos[:, :3], pos[:, :3]), pad)[0, 0, 0], torch.tensor([False, False, False]))


def test_cache_writes_at_slots_and_reorders():
    cache = KVCache.allocate(2, 3, 6, 2, 4, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.layers[0].k.shape == (3, 2, 7, 4)  # one hidden slot for padding tokens
    assert cache.batch_size == 3 and cache.key_positions.tolist() == [list(range(7))]
    k = torch.arange(3 * 2 * 2 * 4, dtype=torch.float32).view(3, 2, 2, 4)
    slots = torch.tensor([[0, 1], [4, 5], [2, 6]])
    ck, cv = cache.layers[0].write(k, -k, slots)
    for b in range(3):
        for t in range(2):
            assert torch.equal(ck[b, :, slots[b, t]], k[b, :, t])
            assert torch.equal(cv[b, :, slots[b, t]], -k[b, :, t])
    assert ck[0, :, 2:].abs().sum() == 0
    cache.cross = [(torch.arange(3.0).view(3, 1, 1, 1), torch.zeros(3, 1, 1, 1))]
    cache.src_mask = torch.tensor([[1], [0], [1]])
    cache.reorder(torch.tensor([2, 2, 0]))
    new = cache.layers[0].k
    assert torch.equal(new[0], ck[2]) and torch.equal(new[1], ck[2]) and torch.equal(new[2], ck[0])
    assert cache.cross[0][0].flatten().tolist() == [2.0, 2.0, 0.0]
    assert cache.src_mask.flatten().tolist() == [1, 1, 1]
