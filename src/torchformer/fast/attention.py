"""The CPU kernel of nn/backends.py's ``torchformer::prefix_sdpa`` (a cached step's attention over
the live prefix of the static cache): one query per row (decoding) in fp32 runs the decode
kernel of csrc/kernels.cpp where it is built (native.py), everything else the op's own SDPA over
the prefix. Registered when this package is imported (generation and serve import it); the
kernel itself is built on its first use, as before. nn/ never imports it."""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.backends import prefix_sdpa, sdpa_prefix
from .native import kernels


@prefix_sdpa.register_kernel("cpu")
def prefix_attention(q: Tensor, k: Tensor, v: Tensor, term: Tensor | None, live: Tensor, scale: float) -> Tensor:
    """q (B, H, T, E) over the first ``live`` slots of k, v (B, K, S, E) -> (B, H, T, E)."""
    n = int(live)
    fp32 = q.dtype == k.dtype == v.dtype == torch.float32 and (term is None or term.dtype == torch.float32)
    unit = q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    if q.shape[2] == 1 and fp32 and unit and kernels() is not None:  # one query per row (decoding)
        return kernels().decode_attention(q, k, v, term, n, scale)  # (B, H, 1, E)
    return sdpa_prefix(q, k, v, term, n, scale)
