"""Asymmetric int4 (Int4MinLinear, w = s * u - m: GGUF's Q4_K) in the CPU kernels' panels
(fast/formats.py Int4MinPanels, csrc int4_min_mm): the product equals x rounded to 8 bits per block
times the dequantized weight, on a grid of shapes and row counts; the state dict is the portable
one; the copies without VNNI give bit-equal products. Helpers (the rounding, the float64
reference, its bound) are test_formats.py's."""

import pytest
import torch
from torch import nn

from tests.fast.test_formats import block, reference, rounded, rounding_bound
from torchformer.fast import formats
from torchformer.nn.quant_min import Int4MinLinear

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (neither AVX-512 nor AVX2, or no compiler)"
)


def portable(n: int, k: int, group: int, bias: bool, seed: int = 0, shift: float = 0.0) -> Int4MinLinear:
    """Int4MinLinear of a random Linear whose weights are moved by ``shift`` (a one-sided range:
    minimums far from the symmetric case)."""
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.add_(shift)
    return Int4MinLinear.from_linear(lin, group).eval()


# (N, K, group): N off the 16-row panel grid, K from one group to several blocks, every group size.
SHAPES = [(40, 64, 32), (33, 128, 32), (48, 512, 64), (20, 256, 128), (16, 96, 16), (17, 64, 8), (64, 256, 32)]


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_product_equals_the_dequantized_reference(n, k, group, rows):
    source = portable(n, k, group, bias=rows % 2 == 1, shift=(rows % 3 - 1) * 0.5 / k**0.5)  # of init's 1 / sqrt(K)
    assert source.minimum.abs().max() > 0
    twin = formats.fits(source)(source)
    assert isinstance(twin, formats.Int4MinPanels)
    x = torch.randn(rows, k)
    with torch.no_grad():
        out = twin(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    # fp32 sums of s * sum(u x) and m * sum(x), which cancel in part: 2e-5 of their size
    torch.testing.assert_close(out.double(), reference(source, rounded(x, block(source))), rtol=1e-5, atol=2e-5)
    error = (out.double() - reference(source, x)).abs()
    assert (error <= rounding_bound(source, x) + 2e-5).all()
    assert error.max() > 1e-6  # the activations were rounded: the reference above is not the exact one


def test_state_dict_is_the_portable_one_and_loads_back():
    source = portable(37, 64, 32, bias=True, shift=0.1)
    twin = formats.fits(source)(source)
    a, b = source.state_dict(), twin.state_dict()
    assert a.keys() == b.keys() == {"qweight", "scale", "minimum", "bias"}
    assert all(torch.equal(a[name], b[name]) and a[name].dtype == b[name].dtype for name in a)
    other = portable(37, 64, 32, bias=True, seed=1, shift=-0.1)
    twin.load_state_dict(other.state_dict())  # repacked from the portable layout
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(twin(x).double(), reference(other, rounded(x, 32)), rtol=1e-5, atol=2e-5)
    assert isinstance(twin, Int4MinLinear)


def products():
    """A minimum-carrying int4 twin's products at 11 rows (tests/fast/no_vnni.py)."""
    torch.manual_seed(1)
    x = torch.randn(11, 128)
    source = portable(40, 128, 32, bias=False, shift=0.05)
    return [x], [formats.fits(source)(source)(x)]


def test_the_kernels_without_vnni_give_the_same_products(no_vnni):
    """TORCHFORMER_VNNI=0 in a child process runs the copies for a CPU without AVX512-VNNI: integer
    sums are exact either way, so the products are bit-equal to this process's."""
    from tests.fast.no_vnni import assert_same_bits

    assert_same_bits("tests.fast.test_quant_min:products", no_vnni)
