"""A GGUF token table looked up as stored (interop/gguf/table.py): each type's rows, random blocks
(every byte pattern is a valid block once its f16 scales are finite), dequantized by the lookup
equal gguf's own dequantization bit for bit, in any order and with repeats; the whole table and
the state dict too; the model's casts change the rows' dtype, never the stored bytes; a table of
the wrong width is refused before any tensor work."""

import numpy as np
import pytest
import torch

from torchformer.interop.gguf.table import ROWS, MappedTable

gguf = pytest.importorskip("gguf")

SCALES = {"Q8_0": [(0, 2)], "Q4_0": [(0, 2)], "Q5_0": [(0, 2)], "Q6_K": [(208, 210)], "Q4_K": [(0, 2), (2, 4)]}


def random_rows(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, bytes) uint8: random blocks whose f16 scales are finite."""
    _, per, size = ROWS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for a, b in SCALES[kind]:
        blocks[..., a:b] = (rng.standard_normal((n, k // per, 1)) * 1e-2).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("kind", list(ROWS))
def test_looked_up_rows_equal_ggufs_dequantization(kind):
    n, k = 41, 512
    rows = random_rows(kind, n, k)
    expected = torch.from_numpy(gguf.quants.dequantize(rows, getattr(gguf.GGMLQuantizationType, kind)))
    table = MappedTable(torch.from_numpy(rows.copy()), kind, k, torch.float32)
    ids = torch.tensor([[40, 0, 7, 7], [3, 12, 40, 1]])  # (2, 4): any order, repeats
    out = table(ids)
    assert out.shape == (2, 4, k) and out.dtype == torch.float32
    assert torch.equal(out, expected[ids])
    assert torch.equal(table.dequantized(), expected)
    assert set(table.state_dict()) == {"weight"} and torch.equal(table.state_dict()["weight"], expected)


def test_a_cast_changes_the_rows_dtype_not_the_bytes():
    rows = random_rows("Q4_K", 9, 256, seed=1)
    table = MappedTable(torch.from_numpy(rows.copy()), "Q4_K", 256, torch.float32)
    raw = table.raw.clone()
    table.to(torch.bfloat16)
    assert table.like.dtype == torch.bfloat16 and torch.equal(table.raw, raw)
    expected = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q4_K))
    ids = torch.tensor([2, 8])
    assert torch.equal(table(ids), expected[ids].to(torch.bfloat16))


def test_a_compiled_lookup_equals_the_eager_one():
    rows = random_rows("Q6_K", 16, 512, seed=2)
    table = MappedTable(torch.from_numpy(rows.copy()), "Q6_K", 512, torch.float32)
    ids = torch.tensor([[5, 0, 15]])
    assert torch.equal(torch.compile(table, fullgraph=True)(ids), table(ids))


@pytest.mark.parametrize("width", [500, 520])
def test_a_table_of_the_wrong_row_bytes_is_refused(width):
    rows = torch.from_numpy(random_rows("Q8_0", 4, 512).copy())
    with pytest.raises(ValueError, match=r"a Q8_0 table of width \d+ has rows of"):
        MappedTable(rows, "Q8_0", width, torch.float32)
