"""GGUF block types read into our modules without llama.cpp: Q5_0 (what llama.cpp's quantizer
writes where a K-quant does not fit a width) made by the ``gguf`` package's own quantizer, read by
interop/gguf/weights.py into Int8Linear (group 32), equals gguf's dequantization bit for bit."""

import numpy as np
import pytest
import torch

from torchformer.interop.gguf.weights import QUANTIZED_LINEARS
from torchformer.nn.quant import Int8Linear

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
