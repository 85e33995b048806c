"""The CPU kernel of nn/backends.py's ``torchformer::prefix_sdpa`` (a cached step's attention over
the live prefix of the static cache): one query per row (decoding) runs the decode kernel of
csrc/kernels.cpp where it is built (native.py), over an fp32 or a bf16 cache (read as it is,
widened in registers; the query and the result go through fp32); everything else the op's own SDPA
over the prefix. torch's SDPA over a bf16 cache took ~10x the kernel's time at one query (143-196
against 11-14 us, B=1, H=8, n=100, E=64, one thread). Registered in Python when this package is
imported (generation and serve import it), the kernel itself built on its first use; once a
generation or serving scope opens with the kernels built, the same choice runs in C++ instead
(``native``). nn/ never imports it."""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.backends import sdpa_prefix
from .native import kernels

CACHE_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads keys and values in
MAX_HEAD = 128  # a bf16 cache needs the register path: E == Ev <= 128


def prefix_attention(q: Tensor, k: Tensor, v: Tensor, term: Tensor | None, live: Tensor, scale: float) -> Tensor:
    """q (B, H, T, E) over the first ``live`` slots of k, v (B, K, S, E) -> (B, H, T, E)."""
    n = int(live)
    if decodes(q, k, v, term) and kernels() is not None:  # one query per row (decoding)
        return kernels().decode_attention(q, k, v, term, n, scale)  # (B, H, 1, E) in q's dtype (fp32 inside)
    return sdpa_prefix(q, k, v, term, n, scale)


def python_kernel() -> torch.library.Library:
    """``prefix_attention`` registered as the op's CPU kernel, in a library of its own (not
    nn/backends.py's), so that ``native`` can drop this registration alone."""
    library = torch.library.Library("torchformer", "IMPL", "CPU")
    library.impl("prefix_sdpa", prefix_attention)
    return library


CPU_KERNEL: torch.library.Library | None = python_kernel()  # None while the C++ one is registered


def native(on: bool = True) -> bool:
    """Give the op's CPU kernel to C++ (csrc/kernels.cpp ``prefix_sdpa``: the same choice of the
    decode kernel or SDPA over the prefix) where the kernels are built, or (``on=False``) back to
    ``prefix_attention``; returns whether the C++ one is registered now. A compiled step's C++ host
    code calls the op through the dispatcher; to the Python kernel it went back into Python each
    time. Called where a generation or serving scope opens (fast/scope.py), never inside a call of
    the op (dropping a kernel while it runs would free it under its caller)."""
    global CPU_KERNEL
    if on and CPU_KERNEL is not None:
        module = kernels()
        if module is None:
            return False
        CPU_KERNEL._destroy()
        CPU_KERNEL = None
        module.register_prefix_sdpa(True)
    elif not on and CPU_KERNEL is None:
        kernels().register_prefix_sdpa(False)
        CPU_KERNEL = python_kernel()
    return CPU_KERNEL is None


def decodes(q: Tensor, k: Tensor, v: Tensor, term: Tensor | None) -> bool:
    """Whether the decode kernel takes this call: one query per row, a cache it reads (fp32 or bf16,
    K and V alike), unit stride on the head dim, and a floating query and term it can widen."""
    cache = k.dtype == v.dtype and k.dtype in CACHE_DTYPES
    floats = q.dtype in CACHE_DTYPES and (term is None or term.dtype in CACHE_DTYPES)
    unit = q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    shape = k.dtype == torch.float32 or q.shape[-1] == v.shape[-1] <= MAX_HEAD
    return q.shape[2] == 1 and cache and floats and unit and shape
