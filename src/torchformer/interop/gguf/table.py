"""A GGUF token table looked up as the file stores it: its quantized rows stay memory-mapped and a
forward dequantizes only the rows it reads, as llama.cpp's ``get_rows`` does.

Why: dequantizing the whole table at load held it in the model's dtype besides the file's bytes
the tied head keeps (weights.py): a Llama-3.2-1B Q8_0 file's 128256 x 2048 table is 501 MiB in
bf16, resident for the lookups of a few rows a step (the engines benchmark measured the Q8_0 file's
generation at 1046 MiB beyond its weights and KV cache). Mapped, only the rows looked up are read
from the file, and a decode step's lookup dequantizes one row a token.

Each type's rows decode in torch (a compiled step traces them) with weights.py's readers of its
bytes (the projections' loaders read the same), scaled in the order of operations of the ``gguf``
package's numpy dequantization, so a looked-up row equals gguf's bit for bit; then the model's
dtype, as the float table was.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from ...nn.quant import row_blocks
from .container import GGUFFile
from .weights import (
    Q4_0_GROUP,
    Q4_K_GROUP,
    Q6_K_GROUP,
    Q8_0_GROUP,
    QK_K,
    blocks,
    nibble_halves,
    q4_k_fields,
    q5_0_values,
    q6_k_scales,
    q6_k_values,
    super_blocks,
)


def q8_0_rows(b: Tensor, k: int) -> Tensor:
    """(R, K / 32 * 34) uint8 -> (R, K) float32: d * q per block of 32."""
    scale, payload = blocks(b, (b.shape[0], k), Q8_0_GROUP)  # (R, K/32), (R, K/32, 32)
    return (scale.unsqueeze(-1) * payload.contiguous().view(torch.int8).float()).flatten(1)


def q4_0_rows(b: Tensor, k: int) -> Tensor:
    """(R, K / 32 * 18) uint8 -> (R, K) float32: d * (nibble - 8), inputs j (low) and j + 16 (high)."""
    scale, payload = blocks(b, (b.shape[0], k), Q4_0_GROUP // 2)  # (R, K/32), (R, K/32, 16)
    return (scale.unsqueeze(-1) * (nibble_halves(payload).float() - 8)).flatten(1)


def q5_0_rows(b: Tensor, k: int) -> Tensor:
    """(R, K / 32 * 22) uint8 -> (R, K) float32: d * (q - 16), q's fifth bit in qh."""
    scale, payload = blocks(b, (b.shape[0], k), 20)  # (R, K/32), (R, K/32, 20)
    return (scale.unsqueeze(-1) * q5_0_values(payload).float()).flatten(1)


def q6_k_rows(b: Tensor, k: int) -> Tensor:
    """(R, K / 256 * 210) uint8 -> (R, K) float32: (d * sc) * q per 16 inputs, q in [-32, 31]."""
    r, s = b.shape[0], super_blocks(b, (b.shape[0], k), 210)  # (R, K/256, 210)
    sc, d = q6_k_scales(s)
    scale = d.float() * sc.float()  # (R, K/256, 16)
    return (scale.reshape(r, -1, 1) * q6_k_values(s).reshape(r, -1, Q6_K_GROUP).float()).flatten(1)


def q4_k_rows(b: Tensor, k: int) -> Tensor:
    """(R, K / 256 * 144) uint8 -> (R, K) float32: (d * sc) * u - dmin * m per 32 inputs."""
    r = b.shape[0]
    d, dmin, sc, m, u = q4_k_fields(super_blocks(b, (r, k), 144))
    scale, minimum = d.float() * sc.float(), dmin.float() * m.float()  # (R, K/256, 8) each
    return (scale.reshape(r, -1, 1) * u.reshape(r, -1, Q4_K_GROUP).float() - minimum.reshape(r, -1, 1)).flatten(1)


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
        return self.rows(flat, self.embedding_dim).to(self.probe.dtype).reshape(*ids.shape, self.embedding_dim)

    def dequantized(self) -> Tensor:
        """The whole table (V, D) in the model's dtype, a block of rows at a time."""
        out = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.probe.dtype, device=self.raw.device)
        for block in row_blocks(self.num_embeddings, self.embedding_dim):
            out[block] = self.rows(self.raw[block], self.embedding_dim).to(out.dtype)
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
