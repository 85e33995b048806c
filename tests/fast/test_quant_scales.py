"""Scales the kernels read as f16 (fast/formats.py ``compact_scales``): a panel twin keeps its
scales in f16 only where f16 holds every one exactly (GGUF's Q8_0 / Q4_0 / Q5_0 block scales), and
its products still equal the rounded x times the portable module's dequantized weight; our own
quantization's fp32 scales stay fp32; the copies without VNNI read f16 scales bit-equally."""

import pytest
import torch

from tests.fast.test_formats import block, portable, reference, rounded
from torchformer.fast import formats
from torchformer.nn.quant import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (neither AVX-512 nor AVX2, or no compiler)"
)


def f16_scaled(kind: str, n: int, k: int, group: int, seed: int = 0):
    """A portable module whose fp32 scales are f16 values (as a GGUF file's d), and its twin."""
    source = portable(kind, n, k, group, bias=True, seed=seed)
    scale = source.scale.half().float()  # exactly representable in f16
    source = (Int8Linear if kind == "int8" else Int4Linear)(source.qweight, scale, source.bias, group)
    return source, formats.fits(source)(source)


@pytest.mark.parametrize("kind,n,k,group", [("int8", 40, 128, 32), ("int8", 33, 96, 16), ("int4", 40, 128, 32)])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_f16_exact_scales_are_read_as_f16_with_the_same_products(kind, n, k, group, rows):
    source, twin = f16_scaled(kind, n, k, group)
    assert twin.scale.dtype == torch.float16
    x = torch.randn(rows, k)
    with torch.no_grad():
        out = twin(x)
    torch.testing.assert_close(out.double(), reference(source, rounded(x, block(source))), rtol=1e-5, atol=1e-5)
    state = twin.state_dict()  # the portable module's: fp32 scales, the same values
    assert state["scale"].dtype == torch.float32 and torch.equal(state["scale"], source.scale)


@pytest.mark.parametrize("kind,group", [("int8", 0), ("int8", 32), ("int4", 64)])
def test_our_own_scales_stay_fp32(kind, group):
    source = portable(kind, 40, 128, group, bias=False)
    assert not torch.equal(source.scale.half().float(), source.scale)
    assert formats.fits(source)(source).scale.dtype == torch.float32


def products():
    """f16-scaled int8 and int4 twins' products at 11 rows (tests/fast/no_vnni.py)."""
    torch.manual_seed(1)
    x = torch.randn(11, 128)
    return [x], [f16_scaled(kind, 40, 128, 32)[1](x) for kind in ("int8", "int4")]


def test_the_kernels_without_vnni_read_f16_scales_the_same(no_vnni):
    from tests.fast.no_vnni import assert_same_bits

    assert_same_bits("tests.fast.test_quant_scales:products", no_vnni)
