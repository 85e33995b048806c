"""How compiled steps are built: the one switch between inductor's Python host code and its C++
host code (``cpp_wrapper``), read where the step is compiled (generation/steps.py) and where a
stack decides whether its layers run through compile regions (models/stack.py), which cpp_wrapper
cannot emit."""

from __future__ import annotations

import os


def cpp_wrapper() -> bool:
    """Whether a compiled step's host code is C++ (inductor's cpp_wrapper) instead of Python:
    ``TORCHFORMER_CPP_WRAPPER=1``. Default off: on the toy's one-thread step it ran 0.2-1 ms (of
    3-5) faster in most interleaved rounds on a busy machine but slower in some, not beyond that
    noise; same tokens. Anything but 0 or 1 is refused."""
    value = os.environ.get("TORCHFORMER_CPP_WRAPPER", "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"TORCHFORMER_CPP_WRAPPER={value!r}: must be 0 or 1")
    return value == "1"
