"""The native kernels for a test that exercises them."""

import pytest
import torch

from torchformer.fast import native


def built_kernels():
    """The built extension module. A CPU without AVX-512 (or TORCHFORMER_NATIVE=0) skips: the kernels
    never run there, the library paths do, and every other test covers those. Where the CPU has
    AVX-512 a failed build fails the test: a skip would hide it."""
    if not native.enabled() or not torch.cpu._is_avx512_supported():
        pytest.skip("the native kernels need AVX-512 (and TORCHFORMER_NATIVE not 0); this CPU runs the library paths")
    module = native.kernels()
    assert module is not None, "the native kernels did not build on this machine (see the log)"
    return module
