"""The native kernels for a test that exercises them."""

import pytest

from torchformer.fast import native


def built_kernels():
    """The built extension module. A CPU the kernels cannot run on (neither AVX-512 nor AVX2 with FMA
    and F16C) or TORCHFORMER_NATIVE=0 skips: the library paths run there, and every other test covers
    those. Where the CPU can run them, a failed build fails the test: a skip would hide it."""
    if not native.enabled() or native.isa() is None:
        pytest.skip("the native kernels need AVX-512 or AVX2 (and TORCHFORMER_NATIVE not 0): library paths here")
    module = native.kernels()
    assert module is not None, "the native kernels did not build on this machine (see the log)"
    return module
