"""``packed(model, rows)``: a model ready for inference products on the CPU while a block runs.

Two things happen on entry. The bf16 and quantized linears move onto the kernels' formats for
good (fast/formats.py: no copies, the same state dict, so nothing needs undoing). And, for
products of MIN_ROWS or more rows (a decode batch, a speculative verify chunk), the fp32 Linears
get a packed copy of their weight for the block only (nn/packed.py), freed on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..nn import packed as copies
from .formats import prepare


@contextlib.contextmanager
def packed(model: nn.Module, rows: int = copies.MIN_ROWS) -> Iterator[None]:
    """Prepare ``model`` (module docstring) and pack its fp32 Linears while the block runs, when its
    products will have >= MIN_ROWS rows (``rows``: the decode batch)."""
    prepare(model)
    modules = copies.pack(model) if rows >= copies.MIN_ROWS else []
    try:
        yield
    finally:
        copies.unpack(modules)
