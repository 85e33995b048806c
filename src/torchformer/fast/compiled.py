"""How compiled steps are built: which host code inductor writes for a decode step, Python's or C++
(``cpp_wrapper``), decided once per model where the step is compiled (generation/steps.py,
serve/engine.py) and, for the forced settings, where a stack decides whether its layers run
through compile regions (models/stack.py), which cpp_wrapper cannot emit; ``compile_step`` is how
generate's and serve's decode steps are compiled."""

from __future__ import annotations

import itertools
import os
import time

import torch
from torch import nn

VALUES = ("auto", "0", "1")


def cpp_wrapper_setting() -> str:
    """``TORCHFORMER_CPP_WRAPPER``: ``auto`` (unset), ``0`` (Python host code always) or ``1`` (C++
    host code always; big layers then run without compile regions). Anything else is refused."""
    value = os.environ.get("TORCHFORMER_CPP_WRAPPER", "auto").strip() or "auto"
    if value not in VALUES:
        raise ValueError(f"TORCHFORMER_CPP_WRAPPER={value!r}: must be auto, 0 or 1")
    return value


def cpp_wrapper_forced() -> bool:
    """Whether stacks must give up compile regions at build: only when C++ host code is forced."""
    return cpp_wrapper_setting() == "1"


def cpp_host(model: nn.Module | None) -> bool:
    """Whether ``model``'s compiled step gets C++ host code. ``auto``: a model on the CPU none of whose
    stacks runs compile regions (layers under models/regions.py's REGION_PARAMS). A small model's
    step is host code more than kernels: on the toy shape (6 layers, hidden 512, batch 1, 2 threads,
    AVX-512 EPYC, best of 5) C++ host code took a token from 1.22 to 0.92 ms (int4), 1.66 to 1.42
    (int8), 2.23 to 2.05 (bf16), and its first compile as long (25.4 vs 25.7 s, cold cache). Big
    layers keep their regions (the 1B shape's first compile stays near 50 s) and so Python host code."""
    setting = cpp_wrapper_setting()
    if setting != "auto":
        return setting == "1"
    if model is None or any(getattr(m, "regions", False) for m in model.modules()):
        return False
    # Measured on CPUs only; an accelerator's step keeps the host code it has always had.
    return on_cpu(model)


def on_cpu(model: nn.Module) -> bool:
    """Whether ``model``'s first tensor (parameter or buffer) is on the CPU (a model with none: True)."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor is None or tensor.is_cpu


def compile_step(fn, cpp: bool):
    """``fn`` compiled as a decode step: static shapes (a new token changes no shape and no guard,
    so it never recompiles), one graph, C++ host code where ``cpp`` (``cpp_host``). Options only
    when set: a test's backend (tests/conftest.py aot_eager) takes none."""
    options = {"cpp_wrapper": True} if cpp else None
    return torch.compile(fn, dynamic=False, fullgraph=True, options=options)


def warm_inductor() -> float:
    """Inductor's one-time work on a machine, done ahead: its probe of the CPU's vector ISA (small
    programs it compiles and runs) and its precompiled header of torch's C++ headers, made by
    compiling one tiny step with each host code into its cache (TORCHINDUCTOR_CACHE_DIR, default
    /tmp/torchinductor_$USER). ~12 s of CPU the first time on a machine (measured: a first
    compiled test 27.5 -> 22.5 s after it), ~1 s once done. Returns the seconds it took."""
    start = time.perf_counter()
    x, w = torch.randn(4, 8), torch.randn(8, 8)  # (4, 8) rows through an (8, 8) weight
    for cpp in (True, False):
        torch._dynamo.reset()  # a fresh compile each time, and nothing left for the caller
        compile_step(lambda x, w: torch.nn.functional.silu(x @ w).sum(-1), cpp)(x, w)
    torch._dynamo.reset()
    return time.perf_counter() - start
