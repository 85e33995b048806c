"""Position schemes: the properties that define them, checked against formulas written here."""

import math

import pytest
import torch

from torchformer.models.build import SINUSOID_LAYOUTS
from torchformer.nn.positions import (
    ALiBiBias,
    RelativePositionBias,
    RotaryTable,
    alibi_slopes,
    rotate_half,
    rotate_interleaved,
    sinusoid_table,
)


@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_sinusoid_values_follow_the_paper(layout):
    D, table = 16, sinusoid_table(50, 16, 10000.0, SINUSOID_LAYOUTS[layout])
    for pos in (0, 1, 7, 49):
        for i in range(D // 2):
            angle = pos / 10000 ** (2 * i / D)
            s, c = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, D // 2 + i)
            assert table[pos, s].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, c].item() == pytest.approx(math.cos(angle), abs=1e-6)


@pytest.mark.parametrize("layout", ["interleaved", "split"])
@pytest.mark.parametrize("k", [1, 5, 37])
def test_sinusoid_shift_is_a_fixed_block_rotation(layout, k):
    """PE(pos + k) = R_k PE(pos) for every pos, with one R_k (Vaswani 2017, 3.5)."""
    N, D = 512, 32
    pe = sinusoid_table(N, D, 10000.0, SINUSOID_LAYOUTS[layout]).double()
    R = torch.zeros(D, D, dtype=torch.float64)
    for i in range(D // 2):
        w = 10000 ** (-2 * i / D)
        s, c = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, D // 2 + i)
        # sin(a + b) = sin a cos b + cos a sin b;  cos(a + b) = cos a cos b - sin a sin b
        R[s, s], R[s, c] = math.cos(k * w), math.sin(k * w)
        R[c, s], R[c, c] = -math.sin(k * w), math.cos(k * w)
    shifted = pe[:-k] @ R.T
    assert (shifted - pe[k:]).abs().max().item() < 1e-5
    # A different shift is a different map: the check can fail.
    assert (pe[:-k] - pe[k:]).abs().max().item() > 0.1


ROTATIONS = {"half": rotate_half, "interleaved": rotate_interleaved}


def scores(rotate, q, k, qpos, kpos, table):
    cq, sq = table(torch.tensor([[qpos]]))
    ck, sk = table(torch.tensor([[kpos]]))
    return (rotate(q, cq, sq) * rotate(k, ck, sk)).sum(-1)


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_rope_scores_depend_only_on_the_offset(pairing):
    rotate, table = ROTATIONS[pairing], RotaryTable(16, 10000.0)
    q, k = torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16)
    ref = scores(rotate, q, k, 5, 2, table)
    for m, n in [(20, 17), (3, 0), (200, 197), (103, 100)]:
        assert (scores(rotate, q, k, m, n, table) - ref).abs().max().item() < 1e-4
    assert (scores(rotate, q, k, 6, 2, table) - ref).abs().max().item() > 1e-3
    # Rotations keep norms, and position 0 is the identity.
    c, s = table(torch.tensor([[37]]))
    assert torch.allclose(rotate(q, c, s).norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    c0, s0 = table(torch.tensor([[0]]))
    assert torch.equal(rotate(q, c0, s0), q)


def test_rope_rows_are_float64_angles_rounded_once_and_no_table_is_held():
    """cos/sin of pos * base^(-2i/E) worked out in float64 by math, rounded to fp32 once, at
    positions up to Llama 3's last (131071), with an attention factor; the module holds the E/2
    frequencies, not a table of every position (32 MiB for 131072 positions of 64 features)."""
    E, base, factor = 64, 500000.0, 1.25
    table = RotaryTable(E, base, attention_factor=factor)
    assert sum(b.numel() for b in table.buffers()) == E // 2
    pos = torch.tensor([[0, 1, 4097, 131071], [5, 70000, 3, 2]])
    c, s = table(pos)
    assert c.shape == s.shape == (2, 1, 4, E // 2) and c.dtype == torch.float32
    for b in range(2):
        for t in range(4):
            for i in range(E // 2):
                angle = pos[b, t].item() * base ** (-2 * i / E)
                # float32 rounding of the float64 value: equal, not close
                assert c[b, 0, t, i].item() == torch.tensor(math.cos(angle) * factor).float().item()
                assert s[b, 0, t, i].item() == torch.tensor(math.sin(angle) * factor).float().item()


def test_rope_frequencies_stay_float64_when_the_model_is_cast():
    """A cast of the whole model (bf16, fp16) leaves the rotation as it was: the frequencies are
    float64 again after it, and the rows equal the uncast module's."""
    table = RotaryTable(16, 10000.0, attention_factor=1.1)
    pos = torch.tensor([[0, 7, 1000, 4095]])
    before = table(pos)
    for cast in (torch.bfloat16, torch.float16, torch.float32):
        table.to(cast)
        assert table.inv_freq.dtype == torch.float64
        for a, b in zip(table(pos), before):
            assert torch.equal(a, b)
    assert table.to("meta").inv_freq.device.type == "meta"  # moves still follow


def test_rope_pairings_differ_by_a_feature_permutation():
    """interleaved(x)[perm] == half(x[perm]) with perm = evens then odds."""
    table = RotaryTable(8, 10000.0)
    x = torch.randn(2, 3, 5, 8)
    c, s = table(torch.arange(5)[None])
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    assert torch.allclose(rotate_interleaved(x, c, s)[..., perm], rotate_half(x[..., perm], c, s), atol=1e-6)


def test_alibi_slopes_match_the_paper():
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0**-i for i in (2, 4, 6, 8)]
    # Not a power of two: 8 slopes of the 8-head set, then every other slope of the 16-head set.
    twelve = [2.0**-i for i in range(1, 9)] + [2.0**-x for x in (0.5, 1.5, 2.5, 3.5)]
    assert torch.allclose(alibi_slopes(12), torch.tensor(twelve))


def test_alibi_bias_is_minus_slope_times_distance():
    bias = ALiBiBias(2)(torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 2]]))
    expected = -torch.tensor([[0, 1, 2], [1, 0, 1], [2, 1, 0]], dtype=torch.float32)
    assert torch.equal(bias[0, 0], expected / 16) and torch.equal(bias[0, 1], expected / 256)


# relative = key - query -> bucket, worked out by hand from T5's formula (32 buckets, distance 128).
BIDIRECTIONAL = {
    0: 0,
    -1: 1,
    -7: 7,
    -8: 8,
    -9: 8,
    -12: 9,
    -20: 10,
    -40: 12,
    -100: 15,
    -1000: 15,
    1: 17,
    8: 24,
    20: 26,
    1000: 31,
}
UNIDIRECTIONAL = {0: 0, 5: 0, 1000: 0, -1: 1, -15: 15, -20: 17, -40: 23, -100: 30, -127: 31, -500: 31}


@pytest.mark.parametrize(("bidirectional", "table"), [(True, BIDIRECTIONAL), (False, UNIDIRECTIONAL)])
def test_relative_buckets_follow_t5(bidirectional, table):
    module = RelativePositionBias(4, 32, 128, bidirectional)
    relative = torch.tensor(list(table))
    assert module.bucket(relative).tolist() == list(table.values())


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_equal_hf_t5(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-300, 300)[None]
    ours = RelativePositionBias(4, 32, 128, bidirectional).bucket(relative)
    theirs = T5Attention._relative_position_bucket(relative, bidirectional, 32, 128)
    assert torch.equal(ours, theirs)


def test_relative_bias_is_one_scalar_per_head_and_bucket():
    module = RelativePositionBias(3, 8, 20, bidirectional=False)
    torch.nn.init.normal_(module.weight)
    q = torch.tensor([[4, 5]])
    k = torch.arange(6)[None]
    bias = module(q, k)
    assert bias.shape == (1, 3, 2, 6)
    buckets = module.bucket(k[:, None, :] - q[:, :, None])[0]
    for h in range(3):
        assert torch.equal(bias[0, h], module.weight[buckets, h])
