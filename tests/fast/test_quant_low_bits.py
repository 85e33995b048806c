"""5- and 6-bit panels (fast/low_bits.py, csrc's Low): an Int8Linear whose values
fit 5 bits (GGUF's Q5_0: [-16, 15]) or 6 (Q6_K: [-32, 31]) gets a twin holding that many bits a
weight, whose products are bit-equal to the same values' 8-bit twin (the integer sums are exact
either way); its portable module and state dict are the source's; a state dict whose values do not
fit widens it back to 8 bits; the copies without VNNI give the same bits."""

import pytest
import torch

from torchformer.fast import formats
from torchformer.fast import low_bits as packing
from torchformer.fast.two_level import TwoLevel
from torchformer.nn.quant import Int8Linear

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (neither AVX-512 nor AVX2, or no compiler)"
)

# (bits of the values, N, K, group, two-level scales): K 2048 takes the K-blocked path at 9 rows
CASES = [(5, 40, 256, 32, False), (5, 33, 2048, 32, False), (6, 40, 512, 16, True), (6, 17, 2048, 16, False),
         (6, 24, 512, None, False)]  # fmt: skip


def source(bits: int, n: int, k: int, group: int | None, two: bool, seed: int = 0) -> Int8Linear:
    """An Int8Linear of random values spanning ``bits`` (both ends present) and scales f16 holds
    (GGUF's block scales), or two-level ones with their parts attached (Q6_K)."""
    g = torch.Generator().manual_seed(seed)
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (n, k), generator=g).to(torch.int8)
    q[0, 0], q[-1, -1] = -half, half - 1
    groups = k // (group or k)
    if two:
        sub = torch.randint(-128, 128, (n, groups), generator=g).to(torch.int8)
        sup = (torch.randn(n, k // 256, generator=g) * 1e-2).half()
        scale = sup.float().repeat_interleave(256 // group, dim=1) * sub.float()
    else:
        scale = (torch.rand(n, groups, generator=g) * 1e-2).half().float()
    module = Int8Linear(q, scale if group else scale[:, 0], torch.randn(n, generator=g), group)
    if two:
        module.scale_parts = TwoLevel(sub, sup, 256)
    return module.eval()


def twins(case, monkeypatch) -> tuple[formats.Int8Panels, formats.Int8Panels]:
    """The case's twin and the same values' 8-bit twin."""
    low = formats.fits(source(*case))(source(*case))
    with monkeypatch.context() as m:
        m.setattr(packing, "low_bits", lambda *_: 8)
        wide = formats.fits(source(*case))(source(*case))
    return low, wide


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_low_bit_twin_is_bit_equal_to_the_8_bit_twin(case, rows, monkeypatch):
    bits, n, k, group, two = case
    low, wide = twins(case, monkeypatch)
    assert low.bits == bits and wide.bits == 8
    assert low.panels.numel() * 8 == wide.in_order("panels").numel() * bits  # bits a weight, padded rows included
    assert (low.super_scale is not None) == two and low.scale.dtype == (torch.int8 if two else torch.float16)
    x = torch.randn(rows, k)
    with torch.no_grad():
        assert torch.equal(low(x), wide(x))
    expected = source(*case).state_dict()
    state = low.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], expected[key]) and state[key].dtype == expected[key].dtype for key in state)
    assert torch.equal(low.dequantized(), source(*case).dequantized())


def test_values_past_the_bits_take_the_next_format():
    module = source(5, 40, 256, 32, False)
    module.qweight[7, 9] = 16  # past 5 bits, within 6
    assert formats.fits(module)(module).bits == 6
    module.qweight[7, 9] = -33  # past 6 bits
    assert formats.fits(module)(module).bits == 8
    module = source(6, 40, 272, 16, False)  # K = 272: 16 divides it, 32 does not
    module.qweight.clamp_(-16, 15)
    assert formats.fits(module)(module).bits == 6


def test_loading_values_that_do_not_fit_widens_the_twin():
    twin = formats.fits(source(5, 40, 256, 32, False))(source(5, 40, 256, 32, False))
    other = source(5, 40, 256, 32, False, seed=1)
    other.qweight[3] = 127  # our own int8 quantization's range
    twin.load_state_dict(other.state_dict())
    assert twin.bits == 8 and torch.equal(twin.dequantized(), other.dequantized())
    expected = formats.fits(other)(other)
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert torch.equal(twin(x), expected(x))


def products():
    """Every CASES twin's products at 9 rows, each at the bits of its values (tests/fast/no_vnni.py)."""
    torch.manual_seed(1)
    xs = [torch.randn(9, c[2]) for c in CASES]
    twins = [formats.fits(source(*c))(source(*c)) for c in CASES]
    assert [t.bits for t in twins] == [c[0] for c in CASES]
    return xs, [t(x) for t, x in zip(twins, xs)]


def test_the_kernels_without_vnni_give_the_same_bits(no_vnni):
    from tests.fast.no_vnni import assert_same_bits

    assert_same_bits("tests.fast.test_quant_low_bits:products", no_vnni)
