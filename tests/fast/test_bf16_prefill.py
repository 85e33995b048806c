"""Prefills in bf16 on a CPU with AMX (fast/quant_panels.py ``bf16_product``, csrc/dequant.cpp): from
BF16_ROWS rows an interleaved int8 / int4 twin multiplies x in bf16 by its W^T, made from the panels a
block at a time. W^T is the reference module's weight rounded to bf16 (checked element by element);
the product is x times the dequantized weight within bf16's rounding of x and w, for every format
that takes it, panel counts off the group grid and blocks of one group; fewer rows, and the formats
that do not take it, keep the integer kernels bit for bit. Run on any CPU the kernel takes
(AVX512-VBMI and -BF16) by setting ``prefill_bf16``; ``bf16_units`` sets it only where AMX is."""

import pytest
import torch

from tests.fast.test_interleaved import twin_of
from torchformer.fast import quant_panels
from torchformer.fast.quant_panels import BF16_ROWS, rows_of

pytestmark = pytest.mark.skipif(
    not quant_panels.ops_ready() or not torch.ops.torchformer.dequant_ready(),
    reason="the CPU kernels are not built here, or this CPU has no AVX512-VBMI / AVX512-BF16",
)


FORMATS = [("int8", 0, False), ("int8", 32, False), ("int4", 32, False), ("int4", 64, True)]


@pytest.mark.parametrize("kind,group,f16", FORMATS)
@pytest.mark.parametrize("panels", [1, 5, 9])
def test_w_transposed_is_the_weight_in_bf16_and_a_prefill_within_its_rounding(kind, group, f16, panels, monkeypatch):
    n, k = 16 * panels - (panels > 1) * 5, 256
    twin = twin_of(kind, n, k, group, f16)
    assert twin.ways > 1 and twin.dequant_bits == (8 if kind == "int8" else 4)
    weight = twin.dequantized()  # (n, k) fp32: the reference module's
    P = -(-n // 16)
    wt = torch.full((k, 16 * P + 5), 7.0, dtype=torch.bfloat16)  # wider than the block: the rest untouched
    torch.ops.torchformer.dequant_t(wt, twin.panels, twin.scale, n, k, group or k, twin.dequant_bits, twin.ways, 0, P)
    assert torch.equal(wt[:, :n], weight.T.to(torch.bfloat16)) and bool((wt[:, 16 * P :] == 7).all())
    x = torch.randn(BF16_ROWS + 3, k)
    twin.prefill_bf16 = True
    monkeypatch.setattr(quant_panels, "BF16_BLOCK_BYTES", 1)  # one group of panels a block
    with torch.no_grad():
        got = twin(x)
    want = x @ weight.T + twin.bias
    bound = (x.abs() @ weight.abs().T) * 2**-7 + 1e-6  # x and w each rounded to bf16 (2^-9), sums in fp32
    assert bool(((got - want).abs() <= bound).all())
    monkeypatch.setattr(quant_panels, "BF16_BLOCK_BYTES", 64 << 20)  # all of it in one block
    with torch.no_grad():
        torch.testing.assert_close(twin(x), got, rtol=1e-2, atol=1e-3)


def test_fewer_rows_and_other_formats_keep_the_integer_kernels():
    twin = twin_of("int4", 40, 256, 32)
    twin.prefill_bf16 = True
    x = torch.randn(BF16_ROWS - 1, 256)
    with torch.no_grad():
        assert torch.equal(twin(x), twin.finish(twin.product(rows_of(x)), x))
    low = twin_of("int4min", 40, 256, 32)
    low.prefill_bf16 = True
    x = torch.randn(BF16_ROWS + 1, 256)
    with torch.no_grad():
        assert low.dequant_bits == 0 and torch.equal(low(x), low.finish(low.product(rows_of(x)), x))


def test_the_op_refuses_a_block_off_the_group_grid_and_panels_in_order():
    twin = twin_of("int4", 16 * 9, 256, 32)
    out = torch.empty(256, 16 * 9, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"whole groups of 4, got \[2, 6\)"):
        torch.ops.torchformer.dequant_t(out, twin.panels, twin.scale, 16 * 9, 256, 32, 4, 4, 2, 6)
    with pytest.raises(RuntimeError, match="out must be a contiguous bf16"):
        torch.ops.torchformer.dequant_t(out[:, :16], twin.panels, twin.scale, 16 * 9, 256, 32, 4, 4, 0, 4)
    plain = twin_of("int4", 16 * 9, 256, 32)
    plain.interleave(1)
    with pytest.raises(RuntimeError, match="the panels do not match"):
        torch.ops.torchformer.dequant_t(out, plain.panels, plain.scale.new_empty(0), 16 * 9, 256, 32, 4, 4, 0, 9)


def test_bf16_activations_stay_bf16():
    """bf16 x takes the route without an fp32 round trip: the output is bf16, bit for bit what fp32
    x holding the same values gives rounded to bf16."""
    twin = twin_of("int4", 48, 256, 32)
    twin.prefill_bf16 = True
    x = torch.randn(BF16_ROWS + 3, 256).to(torch.bfloat16)
    with torch.no_grad():
        got = twin(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, twin(x.float()).to(torch.bfloat16))
        out = twin.multiply(x)
        assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], 48)
