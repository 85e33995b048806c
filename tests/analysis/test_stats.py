"""head_stats on hand-made attention matrices whose entropy, max and distance are known."""

import math

import pytest
import torch

from torchformer.analysis import head_stats


def uniform(T: int, S: int) -> torch.Tensor:
    return torch.full((T, S), 1.0 / S)


def causal_uniform(T: int) -> torch.Tensor:
    w = torch.ones(T, T).tril()
    return w / w.sum(-1, keepdim=True)


def test_uniform_head_has_entropy_ln_n_max_one_over_n():
    w = uniform(4, 4)[None, None]  # (1, 1, 4, 4)
    s = head_stats(w)
    assert s.entropy.item() == pytest.approx(math.log(4), abs=1e-6)
    assert s.max_weight.item() == pytest.approx(0.25, abs=1e-7)
    # row i: mean of |i - j| over j = 0..3 -> 1.5, 1, 1, 1.5
    assert s.distance.item() == pytest.approx(1.25, abs=1e-6)


def test_one_hot_heads_self_and_first_token():
    own = torch.eye(4)
    first = torch.zeros(4, 4)
    first[:, 0] = 1.0
    s = head_stats(torch.stack([own, first])[None])  # (1, 2, 4, 4)
    assert s.entropy.tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    assert s.max_weight.tolist() == pytest.approx([1.0, 1.0])
    assert s.distance.tolist() == pytest.approx([0.0, 1.5])  # mean of i over i = 0..3


def test_causal_uniform_known_values():
    s = head_stats(causal_uniform(4)[None, None])
    assert s.entropy.item() == pytest.approx(sum(math.log(n) for n in (1, 2, 3, 4)) / 4, abs=1e-6)
    assert s.max_weight.item() == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4, abs=1e-6)
    assert s.distance.item() == pytest.approx((0 + 0.5 + 1 + 1.5) / 4, abs=1e-6)


def test_padded_query_rows_are_excluded_and_masked_keys_count_zero():
    w = torch.eye(4)[None, None].clone()
    w[0, 0, 3] = torch.tensor([0.25, 0.25, 0.25, 0.25])  # garbage in the padded query row
    mask = torch.tensor([[1, 1, 1, 0]])
    s = head_stats(w, mask)
    assert s.entropy.item() == pytest.approx(0.0, abs=1e-6)
    assert s.max_weight.item() == pytest.approx(1.0)
    unmasked = head_stats(w)
    assert unmasked.max_weight.item() == pytest.approx((3 + 0.25) / 4)


def test_rows_that_see_nothing_are_not_counted():
    w = torch.zeros(1, 1, 3, 3)
    w[0, 0, 1, 0] = w[0, 0, 2, 0] = 1.0  # row 0 all zero (fully masked)
    s = head_stats(w)
    assert s.distance.item() == pytest.approx((1 + 2) / 2)
    assert s.max_weight.item() == pytest.approx(1.0)


def test_cached_step_aligns_queries_with_the_last_keys():
    w = torch.zeros(1, 1, 1, 5)
    w[..., 0] = 1.0  # the single query sits at key position 4
    assert head_stats(w).distance.item() == pytest.approx(4.0)


def test_batch_and_heads_are_averaged_per_head():
    a = uniform(2, 2)
    b = torch.eye(2)
    w = torch.stack([torch.stack([a, b]), torch.stack([b, b])])  # (B=2, H=2, 2, 2)
    s = head_stats(w)
    assert s.entropy.tolist() == pytest.approx([math.log(2) / 2, 0.0], abs=1e-6)
    assert len(s.rows()) == 2


def test_bad_shapes_are_rejected_with_the_shape():
    with pytest.raises(ValueError, match=r"\(B, H, T, S\)"):
        head_stats(torch.ones(3, 3))
    with pytest.raises(ValueError, match="mask has shape"):
        head_stats(torch.ones(1, 1, 3, 3) / 3, torch.ones(1, 4))
