"""The native kernels for a test that exercises them."""

import pytest

from torchformer.fast import native


def built_kernels(needs: str = "avx2"):
    """The built extension module. A CPU the kernels cannot run on (neither AVX-512 nor AVX2 with FMA
    and F16C, or only AVX2 where the test's kernel is AVX-512 only: ``needs="avx512"``), or
    TORCHFORMER_NATIVE=0, skips: the library paths run there and every other test covers those.
    Where the CPU can run them, a failed build fails the test: a skip would hide it."""
    isa = native.isa()
    if not native.enabled() or isa is None or (needs == "avx512" and isa != "avx512"):
        pytest.skip(f"this kernel needs {needs} (and TORCHFORMER_NATIVE not 0); this CPU runs the library paths")
    module = native.kernels()
    assert module is not None, "the native kernels did not build on this machine (see the log)"
    return module
