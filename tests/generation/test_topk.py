"""generation/topk.py: the blocked top-k and argmax equal torch's own (values always; indices where the
row has no ties, whose order topk leaves open; argmax's first index always), for vocabularies
with and without a partial last block, a maximum in that tail, ties across blocks, masked
(-inf) logits, and rows that are a view of a larger tensor."""

from __future__ import annotations

import pytest
import torch

from torchformer.generation import sampling
from torchformer.generation.topk import BLOCK, MIN_SIZE, argmax, blocks, top_k


def cases(v: int):
    g = torch.Generator().manual_seed(v)
    plain = torch.randn(8, v, generator=g) * 5
    ties = (torch.randn(8, v, generator=g) * 2).round()  # many equal values, the maximum among them
    tail = torch.randn(8, v, generator=g)
    tail[:, -3] = 50.0  # the maximum in the partial last block (when V % BLOCK != 0)
    both = torch.randn(8, v, generator=g)
    both[:, 5] = both[:, -1] = 50.0  # the same maximum in the first block and at the very end
    masked = torch.randn(8, v, generator=g)
    masked[:, ::3] = float("-inf")  # a grammar's mask
    return {"plain": plain, "ties": ties, "tail": tail, "both": both, "masked": masked}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,v", [(1, 8192), (2, 8000), (3, 97)])
def test_argmax_of_small_inputs_is_torchs_in_every_dtype(dtype, rows, v):
    """Below MIN_SIZE the rows go to torch's argmax (16-bit ones widened first): the same index,
    ties included (bf16 rounding makes many)."""
    for name, x in cases(v).items():
        x = x[:rows].to(dtype)
        assert blocks(x) is None
        assert torch.equal(argmax(x), x.argmax(-1)), name


@pytest.mark.parametrize("v", [8192, 8000, 32000 + 7, 128256])
def test_argmax_is_torchs_first_index(v):
    for name, x in cases(v).items():
        assert blocks(x) is not None
        assert torch.equal(argmax(x), x.argmax(-1)), name
        view = x[2:7]  # rows of a larger tensor (the step's logits of some rows)
        assert torch.equal(argmax(view), view.argmax(-1)), name


@pytest.mark.parametrize("v", [8192, 8000, 128256])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_equals_torch_topk(v, k):
    for name, x in cases(v).items():
        values, ids = top_k(x, k)
        want = x.topk(k, dim=-1)
        assert torch.equal(values, want.values), name
        if name in ("plain", "tail", "masked"):  # no ties among the top k: one right order
            assert torch.equal(ids, want.indices), name
        assert torch.equal(x.gather(-1, ids), values), name  # ties: still indices of those values


def test_small_inputs_use_torchs_own():
    x = torch.randn(1, MIN_SIZE // 2)
    assert blocks(x) is None
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(top_k(x, 3)[1], x.topk(3, dim=-1).indices)
    wide = torch.randn(16, 40 * BLOCK)
    assert blocks(wide) is not None  # top-k of more than a quarter of the blocks: torch's own
    assert torch.equal(top_k(wide, 20)[0], wide.topk(20, dim=-1).values)


@pytest.mark.parametrize("v", [8192, 128256])
def test_the_greedy_choice_is_torchs_argmax_over_any_leading_dims(v):
    """generation/sampling.py ``argmax`` (generate's and the speculative check's greedy choice) reads
    the rows in blocks, over (B, V) and (B, T, V) alike: torch's first index, ties and -inf included."""
    for name, x in cases(v).items():
        assert torch.equal(sampling.argmax(x), x.argmax(-1)), name
        x3 = x.reshape(2, 4, v)
        assert torch.equal(sampling.argmax(x3), x3.argmax(-1)), name
