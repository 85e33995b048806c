"""A GGUF token table looked up as the file stores it: its quantized rows stay memory-mapped and a
forward dequantizes only the rows it reads, as llama.cpp's ``get_rows`` does.

Why: dequantizing the whole table at load held it in the model's dtype besides the file's bytes
the tied head keeps (weights.py): a Llama-3.2-1B Q8_0 file's 128256 x 2048 table is 501 MiB in
bf16, resident for the lookups of a few rows a step (the engines benchmark measured the Q8_0 file's
generation at 1046 MiB beyond its weights and KV cache). Mapped, only the rows looked up are read
from the file, and a decode step's lookup dequantizes one row a token.

Each type's rows decode in torch (a compiled step traces them), in the order of operations of the
``gguf`` package's numpy dequantization, so a looked-up row equals gguf's bit for bit (weights.py
has each format's byte layout); then the model's dtype, as the float table was.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from ...nn.quant import row_blocks
from .container import GGUFFile
from .weights import Q4_0_GROUP, QK_K, half, nibble_halves, q4_k_scales


def q8_0_rows(b: Tensor) -> Tensor:
    """(R, K / 32 * 34) uint8 -> (R, K) float32: d * q per block of 32."""
    b = b.reshape(b.shape[0], -1, 34)  # (R, K/32, 34): f16 d, 32 int8 q
    return (half(b[..., :2]).float() * b[..., 2:].contiguous().view(torch.int8).float()).flatten(1)


def q4_0_rows(b: Tensor) -> Tensor:
    """(R, K / 32 * 18) uint8 -> (R, K) float32: d * (nibble - 8), inputs j (low) and j + 16 (high)."""
    b = b.reshape(b.shape[0], -1, 18)  # (R, K/32, 18): f16 d, 16 bytes of nibbles
    return (half(b[..., :2]).float() * (nibble_halves(b[..., 2:]).float() - 8)).flatten(1)


def q5_0_rows(b: Tensor) -> Tensor:
    """(R, K / 32 * 22) uint8 -> (R, K) float32: d * (q - 16), q's fifth bit in qh."""
    b = b.reshape(b.shape[0], -1, 22)  # (R, K/32, 22): f16 d, 4 bytes qh, 16 bytes as Q4_0's
    qh = b[..., 2:6].contiguous().view(torch.int32)  # (R, K/32, 1): bit j = input j's fifth bit
    fifth = (qh >> torch.arange(Q4_0_GROUP, dtype=torch.int32, device=b.device)) & 1  # (R, K/32, 32)
    q = nibble_halves(b[..., 6:]).to(torch.int32) | (fifth << 4)
    return (half(b[..., :2]).float() * (q - 16).float()).flatten(1)


def q6_k_rows(b: Tensor) -> Tensor:
    """(R, K / 256 * 210) uint8 -> (R, K) float32: (d * sc) * q per 16 inputs, q in [-32, 31]."""
    r = b.shape[0]
    b = b.reshape(r, -1, 210)  # (R, K/256, 210)
    ql, qh = b[..., :128].reshape(r, -1, 2, 64), b[..., 128:192].reshape(r, -1, 2, 1, 32)
    sc, d = b[..., 192:208].contiguous().view(torch.int8), half(b[..., 208:])  # (R, K/256, 16), (R, K/256, 1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(4, 1)
    low = nibble_halves(ql)  # (R, K/256, 2, 128): input 128h + i's low 4 bits
    high = ((qh >> shifts) & 3).reshape(low.shape)  # input 128h + 32j + i's top 2 bits
    q = (low | (high << 4)).to(torch.int16) - 32  # (R, K/256, 2, 128)
    scale = d.float() * sc.float()  # (R, K/256, 16)
    return (scale.reshape(r, -1, 16, 1) * q.reshape(r, -1, 16, 16).float()).flatten(1)


def q4_k_rows(b: Tensor) -> Tensor:
    """(R, K / 256 * 144) uint8 -> (R, K) float32: (d * sc) * u - dmin * m per 32 inputs."""
    r = b.shape[0]
    b = b.reshape(r, -1, 144)  # (R, K/256, 144)
    d, dmin = half(b[..., 0:2]).float(), half(b[..., 2:4]).float()  # (R, K/256, 1) each
    sc, m = q4_k_scales(b[..., 4:16])  # (R, K/256, 8) each
    u = nibble_halves(b[..., 16:].reshape(r, -1, 4, 32)).reshape(r, -1, 8, 32).float()  # (R, K/256, 8, 32)
    scale, minimum = (d * sc.float()).unsqueeze(-1), (dmin * m.float()).unsqueeze(-1)  # (R, K/256, 8, 1)
    return (scale * u - minimum).flatten(1)


# GGUF type -> its rows' dequantization and the bytes of one block of QK inputs.
ROWS = {
    "Q8_0": (q8_0_rows, Q4_0_GROUP, 34),
    "Q4_0": (q4_0_rows, Q4_0_GROUP, 18),
    "Q5_0": (q5_0_rows, Q4_0_GROUP, 22),
    "Q6_K": (q6_k_rows, QK_K, 210),
    "Q4_K": (q4_k_rows, QK_K, 144),
}


class MappedTable(nn.Module):
    """An embedding over a GGUF table's quantized rows (``raw``: (V, row bytes) uint8, mapped from
    the file): ``forward(ids)`` -> the rows' values in the model's dtype (``probe``, an empty buffer
    that follows the model's casts). Its state dict holds the dequantized ``weight`` (a saved or
    exported model is an ordinary one), written a block of rows at a time."""

    def __init__(self, raw: Tensor, kind: str, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows, per, size = ROWS[kind]
        if raw.dim() != 2 or dim % per or raw.shape[1] != dim // per * size:
            raise ValueError(
                f"a {kind} table of width {dim} has rows of {dim // per * size} bytes, got {tuple(raw.shape)}"
            )
        self.kind, self.num_embeddings, self.embedding_dim = kind, raw.shape[0], dim
        self.register_buffer("raw", raw)
        self.register_buffer("probe", torch.empty(0, dtype=dtype, device=raw.device), persistent=False)

    @property
    def like(self) -> Tensor:
        """A tensor of the lookup's dtype and device (a KV cache's, decoder.new_cache)."""
        return self.probe

    def forward(self, ids: Tensor) -> Tensor:  # (...,) -> (..., D)
        flat = self.raw.index_select(0, ids.reshape(-1))  # (R, row bytes)
        return self.rows(flat).to(self.probe.dtype).reshape(*ids.shape, self.embedding_dim)

    def dequantized(self) -> Tensor:
        """The whole table (V, D) in the model's dtype, a block of rows at a time."""
        out = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.probe.dtype, device=self.raw.device)
        for block in row_blocks(self.num_embeddings, self.embedding_dim):
            out[block] = self.rows(self.raw[block]).to(out.dtype)
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.dequantized()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind} rows mapped from the file"


def mapped_rows(f: GGUFFile, name: str) -> Tensor:
    """The tensor ``name``'s bytes (rows, row bytes) uint8 over a copy-on-write mapping of the file:
    no byte is read until a row is (a private mapping, so torch gets a writable array)."""
    t = f.tensors[name]
    rows = f.torch_shape(name)[0]
    data = np.memmap(f.path, dtype=np.uint8, mode="c", offset=int(t.data_offset), shape=(int(t.n_bytes),))
    return torch.from_numpy(data).view(rows, -1)
