"""RoPE row permutations, fused-qkv split/fuse and the generic key map."""

from __future__ import annotations

import pytest
import torch

from torchformer.interop.keymap import KeyMap, rule
from torchformer.interop.transforms import (
    fuse_rows,
    half_to_interleaved,
    interleaved_to_half,
    split_rows,
    transpose,
)
from torchformer.nn.positions import RotaryTable, rotate_half, rotate_interleaved

GRID = [(n, e) for n in (1, 2, 4) for e in (2, 4, 8, 16)]


@pytest.mark.parametrize("n_heads, head_dim", GRID)
@pytest.mark.parametrize("trailing", [(), (6,)])
def test_permute_then_inverse_is_identity(n_heads, head_dim, trailing):
    t = torch.randn(n_heads * head_dim, *trailing)  # a weight (rows, D) or a bias (rows,)
    assert torch.equal(interleaved_to_half(half_to_interleaved(t, n_heads), n_heads), t)
    assert torch.equal(half_to_interleaved(interleaved_to_half(t, n_heads), n_heads), t)


@pytest.mark.parametrize("n_heads, head_dim", GRID)
def test_half_to_interleaved_moves_pair_partners_next_to_each_other(n_heads, head_dim):
    rows = torch.arange(n_heads * head_dim)
    out = half_to_interleaved(rows, n_heads).view(n_heads, head_dim // 2, 2)
    for h in range(n_heads):
        for i in range(head_dim // 2):
            # pair (i, i + E/2) of head h lands at (2i, 2i + 1)
            assert out[h, i].tolist() == [h * head_dim + i, h * head_dim + i + head_dim // 2]


@pytest.mark.parametrize("head_dim", [2, 8, 16])
def test_permuted_rows_rotate_the_same_under_the_other_pairing(head_dim):
    """rotate_interleaved(P x) == P rotate_half(x): why permuted q/k give identical scores."""
    x = torch.randn(2, 3, 5, head_dim)  # (B, H, T, E)
    cos, sin = RotaryTable(head_dim, 10000.0)(torch.arange(5)[None].expand(2, -1))
    perm = lambda t: half_to_interleaved(t.movedim(-1, 0), 1).movedim(0, -1)  # noqa: E731
    assert torch.allclose(rotate_interleaved(perm(x), cos, sin), perm(rotate_half(x, cos, sin)), atol=1e-6)


def test_split_fuse_and_transpose_invert_each_other():
    fused = torch.randn(12, 4)
    parts = split_rows(fused, [4, 4, 4])
    assert [p.shape for p in parts] == [(4, 4)] * 3
    assert all(p.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr() for p in parts)
    assert torch.equal(fuse_rows(parts), fused)
    assert torch.equal(transpose(transpose(fused)), fused)


KEYS = KeyMap(
    [
        rule("embed.weight", "wte.weight"),
        rule(
            ("blocks.{i}.q.weight", "blocks.{i}.k.weight"),
            "h.{i}.qk.weight",
            lambda ts: split_rows(ts[0], [2, 2]),
            lambda ts: [fuse_rows(ts)],
        ),
    ]
)


def test_keymap_converts_both_ways_and_groups_by_layer():
    ours = {f"blocks.{i}.{p}.weight": torch.randn(2, 3) for i in range(2) for p in "qk"}
    ours["embed.weight"] = torch.randn(5, 3)
    theirs = KEYS.to_theirs(ours)
    assert sorted(theirs.tensors) == ["h.0.qk.weight", "h.1.qk.weight", "wte.weight"]
    assert torch.equal(theirs.tensors["h.1.qk.weight"][2:], ours["blocks.1.k.weight"])
    back = KEYS.to_ours(theirs.tensors, theirs.tensors.__getitem__)
    assert back.unmatched == [] and back.missing == []
    assert all(torch.equal(back.tensors[k], v) for k, v in ours.items())


def test_keymap_reports_unmatched_and_missing_names():
    ours = {"blocks.0.q.weight": torch.randn(2, 3), "blocks.0.extra": torch.randn(1), "embed.weight": torch.ones(1)}
    out = KEYS.to_theirs(ours)
    assert out.unmatched == ["blocks.0.extra"]
    assert out.missing == ["blocks.0.k.weight"]
    assert list(out.tensors) == ["wte.weight"]
