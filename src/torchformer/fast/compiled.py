"""How compiled steps are built: the one switch between inductor's Python host code and its C++
host code (``cpp_wrapper``), read where the step is compiled (generation/steps.py) and where a
stack decides whether its layers run through compile regions (models/stack.py), which cpp_wrapper
cannot emit; ``compile_step`` is how generate's and serve's decode steps are compiled."""

from __future__ import annotations

import os

import torch


def cpp_wrapper() -> bool:
    """Whether a compiled step's host code is C++ (inductor's cpp_wrapper) instead of Python:
    ``TORCHFORMER_CPP_WRAPPER=1``. Default off, for now: on the toy's one-thread step it ran 0.2-1 ms
    (of 3-5) faster in most interleaved rounds on a busy machine, and on a quiet one (2 threads,
    batch 1, 5 interleaved rounds, a process per arm) it decoded int8 1.08x and int4 1.43x faster
    (medians; same tokens), but it turns off the big layers' compile regions (models/regions.py:
    cpp_wrapper cannot emit one), which the 1B shape's first compile needs to stay near 50 s, and
    its C++ host code lengthens every compile. Anything but 0 or 1 is refused."""
    value = os.environ.get("TORCHFORMER_CPP_WRAPPER", "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"TORCHFORMER_CPP_WRAPPER={value!r}: must be 0 or 1")
    return value == "1"


def compile_step(fn):
    """``fn`` compiled as a decode step: static shapes (a new token changes no shape and no guard,
    so it never recompiles), one graph, the host code the switch picks. Options only when set: a
    test's backend (tests/conftest.py aot_eager) takes none."""
    options = {"cpp_wrapper": True} if cpp_wrapper() else None
    return torch.compile(fn, dynamic=False, fullgraph=True, options=options)
