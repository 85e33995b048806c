"""GGUF tensors -> torch: float types as they are, Q4_0 into ``Int4Linear`` (the same numbers and
the same nibble order) and Q8_0 into ``Int8Linear`` with a scale per 32 inputs (the same numbers),
every other type dequantized at load by the ``gguf`` package.

Q4_0 (llama.cpp ggml-quants): blocks of 32 inputs, an f16 scale d and 16 bytes; byte j holds input
j (low nibble) and input j + 16 (high nibble), weight = d * (nibble - 8). nn/quant.py's Int4Linear
with group 32 stores byte j of a group as input j (low) and j + G/2 (high), value + 8, times an fp32
scale: the bytes are copied as they are and d widened to fp32, so its dequantized weight equals
gguf's dequantization bit for bit. Q8_0 (blocks of 32 inputs: an f16 scale d and 32 int8 q,
weight = d * q) is Int8Linear with group 32: q copied as it is, d widened to fp32.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...nn.quant import Int4Linear, Int8Linear
from .container import FLOAT_TYPES, GGUFFile, gguf_module

Q4_0_GROUP = Q8_0_GROUP = 32


def raw_rows(f: GGUFFile, name: str) -> Tensor:
    """A tensor's stored bytes or values as a torch tensor, one row per output row; a copy (the
    reader maps the file read-only, and a model owns its weights)."""
    data = np.asarray(f.tensors[name].data)
    if f.type_name(name) == "BF16":  # stored as raw 16-bit words
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).reshape(f.torch_shape(name))
    return torch.from_numpy(data.copy())


def float_tensor(f: GGUFFile, name: str, rows: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """The tensor of ``shape`` in ``dtype`` from its rows (raw_rows, after any row transform or an
    expert's slice)."""
    kind = f.type_name(name)
    if kind in FLOAT_TYPES:
        return rows.reshape(shape).to(dtype)
    gguf = gguf_module()
    values = gguf.quants.dequantize(rows.numpy(), f.tensors[name].tensor_type)
    return torch.from_numpy(values).reshape(shape).to(dtype)


def blocks(rows: Tensor, shape: tuple[int, int], payload: int) -> tuple[Tensor, Tensor]:
    """A Q4_0 / Q8_0 matrix's rows (N, K / 32 * (2 + payload)) uint8 -> its f16 block scales widened
    to fp32 (N, K/32) and the blocks' payload bytes (N, K/32, payload)."""
    n, k = shape
    b = rows.reshape(n, k // Q4_0_GROUP, 2 + payload)  # (N, K/32, 2 + payload): f16 d, then the values
    return b[..., :2].contiguous().view(torch.float16).reshape(n, k // Q4_0_GROUP).float(), b[..., 2:]


def q4_0_linear(rows: Tensor, shape: tuple[int, int], bias: Tensor | None) -> Int4Linear:
    """Int4Linear (group 32) holding a Q4_0 matrix's bytes; rows: (N, K / 32 * 18) uint8."""
    scale, payload = blocks(rows, shape, Q4_0_GROUP // 2)
    qweight = payload.reshape(shape[0], shape[1] // 2).clone()  # (N, K/2): byte j = inputs j, j + 16 of a block
    return Int4Linear(qweight, scale, bias, Q4_0_GROUP)


def q8_0_linear(rows: Tensor, shape: tuple[int, int], bias: Tensor | None) -> Int8Linear:
    """Int8Linear (group 32) holding a Q8_0 matrix's values; rows: (N, K / 32 * 34) uint8."""
    scale, payload = blocks(rows, shape, Q8_0_GROUP)
    qweight = payload.contiguous().view(torch.int8).reshape(shape)  # (N, K)
    return Int8Linear(qweight, scale, bias, Q8_0_GROUP)


# GGUF type -> (the loader of a projection stored in it, our scheme). Each keeps the file's numbers.
QUANTIZED_LINEARS = {"Q4_0": (q4_0_linear, "int4"), "Q8_0": (q8_0_linear, "int8")}
