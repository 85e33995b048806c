"""Static, preallocated key/value cache (DESIGN section 4).

Each layer keeps k and v of shape (B, K, S_max + 1, E). Token t of row b is written at slot
positions[b, t]: slots are the row's own positions, so a left-padded row's cache starts at 0
like the row alone would. Padding tokens are written to the extra last slot, which no query can
see (its index exceeds every position). Shapes never change, so a compiled decode step does not
recompile per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..host_memory import zeroed_pages

CPU = torch.device("cpu")


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """torch.zeros for one cache tensor; on the CPU, from OWN_MAPPING bytes, in a mapping of its own
    (host_memory.py ``zeroed_pages``): freed whole at the end of a generate call, never a hole in
    the heap, and a page is resident only once a position in it is written."""
    on_cpu = torch.device(device).type == CPU.type
    pages = zeroed_pages(math.prod(shape) * dtype.itemsize) if on_cpu else None
    if pages is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps the mapping


@dataclass
class LayerCache:
    k: Tensor  # (B, K, S_max + 1, E)
    v: Tensor  # (B, K, S_max + 1, E)

    def write(self, k: Tensor, v: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, K, T, E) at slots (B, T); return the whole cache to attend over."""
        # index_put_ rather than scatter_: inductor updates it in place in a compiled decode step,
        # where a scatter_ into the cache becomes a copy of the whole cache every token.
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        self.k[rows, :, slots] = k.transpose(1, 2)  # indexed view: (B, T, K, E)
        self.v[rows, :, slots] = v.transpose(1, 2)
        return self.k, self.v


@dataclass
class KVCache:
    """Self-attention caches per layer plus, for encoder-decoders, cross-attention K/V and the
    source padding mask, computed once from the encoder output."""

    layers: list[LayerCache]
    max_len: int
    cross: list[tuple[Tensor, Tensor]] | None = None
    src_mask: Tensor | None = None

    @classmethod
    def allocate(
        cls,
        n_layers: int,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        v_dim: int | None = None,
    ) -> KVCache:
        """v_dim None: values as wide as keys. Latent attention stores (latent, rotary key) in the
        k and v slots (nn/latent_attention.py): one head, widths kv_rank and rope_dim."""
        shape = (batch_size, n_kv_heads, max_len + 1, head_dim)
        v_shape = shape[:-1] + (head_dim if v_dim is None else v_dim,)
        layers = [
            LayerCache(cache_zeros(shape, dtype, device), cache_zeros(v_shape, dtype, device)) for _ in range(n_layers)
        ]
        return cls(layers=layers, max_len=max_len)

    @property
    def batch_size(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def key_positions(self) -> Tensor:
        """Slot index of every cached key: (1, S_max + 1)."""
        return torch.arange(self.max_len + 1, device=self.layers[0].k.device)[None, :]

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` (B',) of every tensor, in place of the old batch (beam search)."""
        for layer in self.layers:
            layer.k = layer.k.index_select(0, index)
            layer.v = layer.v.index_select(0, index)
        if self.cross is not None:
            self.cross = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross]
        if self.src_mask is not None:
            self.src_mask = self.src_mask.index_select(0, index)
