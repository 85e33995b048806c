"""A CPU KV cache from host_memory.OWN_MAPPING bytes lives in a mapping of its own
(host_memory.zeroed_pages), not in glibc's heap: zeros that cost no memory until a position is
written, and a decode that reads and writes it like any other tensor."""

from __future__ import annotations

import sys

import pytest
import torch

from torchformer.host_memory import OWN_MAPPING
from torchformer.nn.kv_cache import KVCache, cache_zeros


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def heap_range() -> tuple[int, int] | None:
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                return low, high
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
def test_a_large_cache_is_outside_the_heap_and_resident_only_where_written():
    # (2 layers) x k, v of (4, 8, 1025, 64) fp32: 8 MiB each, 64 MiB in all.
    before = resident_mib()
    cache = KVCache.allocate(4, 4, 1024, 8, 64, dtype=torch.float32, device=torch.device("cpu"))
    allocated = resident_mib() - before
    heap = heap_range()
    for layer in cache.layers:
        for t in (layer.k, layer.v):
            assert t.shape == (4, 8, 1025, 64) and t.dtype == torch.float32 and not t.any()
            ptr = t.untyped_storage().data_ptr()
            assert ptr % 4096 == 0, "not a mapping of its own"
            assert heap is None or not heap[0] <= ptr < heap[1], "in glibc's heap"
    assert allocated < 8, f"{allocated:.1f} MiB resident for an unwritten 64 MiB cache"
    for layer in cache.layers:
        layer.k.fill_(1.0)
        layer.v.fill_(1.0)
    assert resident_mib() - before > 56  # written: every page now resident
    assert all(layer.k.sum() == layer.k.numel() for layer in cache.layers)


def test_small_and_other_device_caches_are_plain_zeros():
    small = cache_zeros((1, 2, 16, 8), torch.float32, "cpu")  # far below OWN_MAPPING
    assert small.numel() * 4 < OWN_MAPPING and not small.any() and small.untyped_storage().resizable()
    big = cache_zeros((OWN_MAPPING // 2,), torch.bfloat16, "cpu")
    assert big.dtype == torch.bfloat16 and big.shape == (OWN_MAPPING // 2,) and not big.any()
    assert not big.untyped_storage().resizable()  # the mapping's bytes, not torch's allocator
    assert cache_zeros((OWN_MAPPING,), torch.float32, "meta").device.type == "meta"


def test_the_cache_reorders_and_writes_like_a_plain_one():
    cache = KVCache.allocate(2, 2, 2048, 4, 64, dtype=torch.float32, device=torch.device("cpu"))
    assert not cache.layers[0].k.untyped_storage().resizable()
    k = torch.randn(2, 4, 3, 64)
    v = torch.randn(2, 4, 3, 64)
    slots = torch.tensor([[0, 1, 2], [5, 6, 7]])
    full_k, full_v = cache.layers[1].write(k, v, slots)
    assert torch.equal(full_k[0, :, :3], k[0]) and torch.equal(full_v[1, :, 5:8], v[1])
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.layers[1].k[0, :, 5:8], k[1]) and torch.equal(cache.layers[1].k[1, :, 5:8], k[1])


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork (POSIX)")
def test_a_forked_child_writes_its_own_copy_of_the_cache():
    import os

    cache = KVCache.allocate(1, 1, 4096, 4, 64, dtype=torch.float32, device=torch.device("cpu"))  # 4 MiB a tensor
    k = cache.layers[0].k
    pid = os.fork()
    if pid == 0:  # the child writes a few elements (too few for a parallel region) and leaves at once
        k.view(-1)[:8].fill_(7.0)
        os._exit(0)
    os.waitpid(pid, 0)
    assert not k.view(-1)[:8].any(), "the child's writes reached the parent's cache (a shared mapping)"
