"""``packed(model, rows)``: a model ready for inference products on the CPU while a block runs.

Two things happen on entry. The bf16 and quantized linears move onto the kernels' formats for
good (fast/formats.py: no copies, the same state dict, so nothing needs undoing). And, for
products of MIN_ROWS or more rows (a decode batch, a speculative verify chunk), the fp32 Linears
are swapped for twins with a packed copy of their weight for the block only (fast/panels.py);
the originals come back on exit.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from torch import nn

from . import attention
from . import panels as copies
from .compiled import on_cpu
from .formats import prepare


@contextlib.contextmanager
def packed(model: nn.Module, rows: int = copies.MIN_ROWS) -> Iterator[None]:
    """Prepare ``model`` (module docstring) and pack its fp32 Linears while the block runs, when its
    products will have >= MIN_ROWS rows (``rows``: the decode batch). A tensor-parallel model runs
    as it is: its Linears carry their parallel styles' hooks, which a twin would not."""
    if split(model):
        yield
        return
    prepare(model)
    if on_cpu(model):
        attention.native()  # the cached steps' attention op without a way back into Python
    swaps = copies.pack(model) if rows >= copies.MIN_ROWS else []
    try:
        yield
    finally:
        copies.unpack(swaps)


def split(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor weights (parallel/apply.py). No DTensor exists before
    torch.distributed.tensor is imported, so a plain model never pays for that import here."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in model.parameters())
