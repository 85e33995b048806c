"""Named tensor transforms between checkpoint layouts. All work on meta tensors too (shapes only),
which is how the loader predicts a checkpoint's shapes before reading any data.

Legend: n heads, E head dim, D model width.
"""

from __future__ import annotations

import torch
from torch import Tensor


def transpose(t: Tensor) -> Tensor:
    """GPT-2's Conv1D stores (in, out); nn.Linear stores (out, in)."""
    return t.t().contiguous()


def split_rows(t: Tensor, sizes: list[int]) -> list[Tensor]:
    """A fused projection (sum(sizes), ...) -> one tensor per part, each with its own storage
    (safetensors refuses tensors that share memory)."""
    return [part.clone() for part in t.split(sizes, dim=0)]


def fuse_rows(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts, dim=0)


def half_to_interleaved(t: Tensor, n_heads: int) -> Tensor:
    """Rows of a q or k projection (weight (n*E, D) or bias (n*E,)) from the half-split RoPE
    layout (feature i pairs with i + E/2, HF Llama) to the interleaved one (2i with 2i + 1, Meta):
    new row 2i + j = old row j*E/2 + i."""
    rest = t.shape[1:]
    e = t.shape[0] // n_heads
    return t.reshape(n_heads, 2, e // 2, *rest).transpose(1, 2).reshape(t.shape)  # (n*E, ...)


def interleaved_to_half(t: Tensor, n_heads: int) -> Tensor:
    """The inverse of ``half_to_interleaved``."""
    rest = t.shape[1:]
    e = t.shape[0] // n_heads
    return t.reshape(n_heads, e // 2, 2, *rest).transpose(1, 2).reshape(t.shape)  # (n*E, ...)


def as_row(t: Tensor) -> Tensor:
    """(V,) -> (1, V): BART keeps final_logits_bias as a (1, V) buffer."""
    return t.reshape(1, -1)


def as_vector(t: Tensor) -> Tensor:
    return t.reshape(-1)


def split_head_interleaved(t: Tensor, n_heads: int, parts: int = 3) -> list[Tensor]:
    """A fused projection stored head by head, [q_h; k_h; v_h] for each head h (GPT-NeoX
    ``query_key_value``: weight (n*3*E, D) or bias (n*3*E,)) -> q, k, v of (n*E, ...) each."""
    rest = t.shape[1:]
    grouped = t.reshape(n_heads, parts, -1, *rest)  # (n, 3, E, ...)
    return [grouped[:, j].reshape(-1, *rest).clone() for j in range(parts)]  # (n*E, ...) each


def fuse_head_interleaved(tensors: list[Tensor], n_heads: int) -> Tensor:
    """The inverse of ``split_head_interleaved``."""
    rest = tensors[0].shape[1:]
    grouped = torch.stack([t.reshape(n_heads, -1, *rest) for t in tensors], dim=1)  # (n, 3, E, ...)
    return grouped.reshape(-1, *rest)  # (n*3*E, ...)
