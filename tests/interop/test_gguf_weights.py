"""GGUF block types read into our modules without llama.cpp: Q5_0 (what llama.cpp's quantizer
writes where a K-quant does not fit a width) made by the ``gguf`` package's own quantizer, read by
interop/gguf/weights.py into Int8Linear (group 32), and Q6_K (random super-blocks) into Int8Linear
(group 16), each equal to gguf's dequantization bit for bit, and so are their kernel twins, which
hold 5 / 6 bits a weight."""

import numpy as np
import pytest
import torch

from torchformer.fast import formats
from torchformer.interop.gguf.table import ROWS
from torchformer.interop.gguf.weights import QUANTIZED_LINEARS
from torchformer.nn import quant
from torchformer.nn.quant import Int8Linear

from .test_gguf_table import random_rows

gguf = pytest.importorskip("gguf")


def test_q5_0_loads_into_int8_group_32_with_the_files_numbers():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero block (d = 0)
    rows = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)  # (24, 3 * 22) uint8
    load, scheme = QUANTIZED_LINEARS["Q5_0"]
    module = load(torch.from_numpy(rows.copy()), (24, 96), None)
    assert isinstance(module, Int8Linear) and module.group_size == 32 and scheme == "int8"
    expected = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q5_0))
    assert torch.equal(module.dequantized(), expected)
    q = module.qweight
    assert q.min() == -16 and q.max() == 15  # the fifth bit used: values past Q4_0's [-8, 7]
    if formats.ops_ready():  # the kernels' twin holds 5 bits a weight (fast/quant_panels.py low_bits)
        twin = formats.fits(module)(module)
        assert twin.bits == 5 and twin.scale.dtype == torch.float16
        assert torch.equal(twin.dequantized(), expected)


def test_q6_k_loads_into_int8_group_16_and_runs_from_6_bits():
    """Random Q6_K super-blocks (every byte pattern is a valid one; gguf has no Q6_K quantizer):
    the module and its twin (6 bits a weight, two-level scales) equal gguf's dequantization."""
    rng = np.random.default_rng(0)
    n, k = 20, 512
    blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    blocks[..., 208:] = (rng.standard_normal((n, k // 256, 1)) * 1e-3).astype(np.float16).view(np.uint8)  # d
    rows = blocks.reshape(n, -1)
    load, scheme = QUANTIZED_LINEARS["Q6_K"]
    module = load(torch.from_numpy(rows.copy()), (n, k), None)
    assert isinstance(module, Int8Linear) and module.group_size == 16 and scheme == "int8"
    expected = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q6_K))
    assert torch.equal(module.dequantized(), expected)
    assert module.qweight.min() == -32 and module.qweight.max() == 31
    if formats.ops_ready():
        twin = formats.fits(module)(module)
        assert twin.bits == 6 and twin.scale.dtype == torch.int8 and twin.super_group == 256
        assert torch.equal(twin.dequantized(), expected)
        x = torch.randn(2, k)
        with torch.no_grad():
            out = twin(x)
        # The kernel rounds x to 8 bits per block of 16 inputs (step max|x_block| / 127): the product
        # is off by at most half a step times each block's sum of |w| (fast/quant_panels.py).
        step = x.view(2, -1, 16).abs().amax(-1) / 127  # (2, K/16)
        bound = 0.5 * step @ expected.abs().view(n, -1, 16).sum(-1).T  # (2, N)
        assert ((out - x @ expected.T).abs() <= bound * 1.001 + 1e-6).all()


def test_q6_k_unpacked_a_few_rows_at_a_time_equals_the_whole(monkeypatch):
    """by_rows (the load's memory: a whole head's temporaries at once were ~1.3 GB at the 1B shape):
    with blocks of 3 rows, the last one short, the values are gguf's dequantization as before."""
    from torchformer.interop.gguf import weights

    rng = np.random.default_rng(1)
    n, k = 20, 512
    blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    blocks[..., 208:] = (rng.standard_normal((n, k // 256, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    rows = blocks.reshape(n, -1)
    monkeypatch.setattr(quant, "BLOCK_BYTES", 3 * 4 * k)  # row_blocks: 3 rows of float32
    module = weights.q6_k_linear(torch.from_numpy(rows.copy()), (n, k), None)
    expected = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q6_K))
    assert torch.equal(module.dequantized(), expected)


@pytest.mark.parametrize("kind", ["Q5_1", "Q4_0", "F16"])
def test_a_tensor_loaded_as_floats_is_dequantized_a_block_of_rows_at_a_time(monkeypatch, kind):
    """float_tensor dequantizes a few rows at a time into the result (gguf's whole-tensor
    dequantization held ~1 GB of float32 and its intermediates for a 1B token table): with blocks of
    2 rows it equals gguf's dequantization of the whole tensor, in the dtype asked for."""
    from torchformer.interop.gguf import weights

    kind_id = getattr(gguf.GGMLQuantizationType, kind)
    w = np.random.default_rng(2).standard_normal((7, 512)).astype(np.float32)
    stored = w.astype(np.float16) if kind == "F16" else gguf.quants.quantize(w, kind_id)

    class File:  # float_tensor reads the type of the name only
        tensors = {"t": type("T", (), {"tensor_type": kind_id})()}

        @staticmethod
        def type_name(name):
            return kind

    monkeypatch.setattr(quant, "BLOCK_BYTES", 2 * 4 * 512)  # row_blocks: 2 rows of float32
    out = weights.float_tensor(File, "t", torch.from_numpy(stored.copy()), torch.bfloat16, (7, 512))
    expected = torch.from_numpy(gguf.quants.dequantize(stored, kind_id).astype(np.float32)).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


@pytest.mark.parametrize("kind", list(ROWS))
def test_a_projection_assembled_a_block_of_rows_at_a_time_equals_the_whole(monkeypatch, kind):
    """weights.assembled (the load's memory: the whole portable module beside its panels held the
    largest tensor twice): with blocks of 32 rows, the loader never sees every row at once, and the
    module is the one made from the whole matrix (panels, scales, bits, bias), gguf's numbers."""
    from torchformer.interop.gguf import weights

    n, k = 72, 512  # 3 blocks of 32 rows (row_blocks keeps multiples of 16), the last short
    rows = torch.from_numpy(random_rows(kind, n, k).copy())
    load = QUANTIZED_LINEARS[kind][0]
    bias = torch.randn(n)
    whole = formats.prepared(load(rows, (n, k), bias))
    seen = []

    def spy(raw, shape, b):
        seen.append(shape[0])
        return load(raw, shape, b)

    monkeypatch.setattr(quant, "BLOCK_BYTES", 32 * 4 * k)  # row_blocks: 32 rows of float32
    module = weights.assembled(spy, rows, (n, k), bias)
    assert type(module) is type(whole)
    expected = torch.from_numpy(gguf.quants.dequantize(rows.numpy(), getattr(gguf.GGMLQuantizationType, kind)))
    assert torch.equal(module.dequantized(), expected) and torch.equal(module.bias, bias)
    state = dict(module.named_buffers())
    assert state.keys() == dict(whole.named_buffers()).keys()
    for name, t in whole.named_buffers():
        assert t.dtype == state[name].dtype and torch.equal(t, state[name]), name
    assert getattr(module, "bits", None) == getattr(whole, "bits", None)
    assert getattr(module, "super_group", 0) == getattr(whole, "super_group", 0)
    if formats.ops_ready():
        assert max(seen) < n, seen  # never the whole matrix at once
        x = torch.randn(3, k)
        with torch.no_grad():
            assert torch.equal(module(x), whole(x))
