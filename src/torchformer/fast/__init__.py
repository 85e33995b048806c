"""The CPU fast paths in one room: the native kernels (csrc/, built by native.py), the modules that
run products on their packed layouts (quant_panels.py, panels.py; formats.py picks, scope.py swaps) and the decode
attention kernel behind nn/'s ``prefix_sdpa`` op (attention.py, registered on import). nn/ never
imports this package: every fast path has a reference in nn/ it is tested against."""

from . import attention  # noqa: F401 - registers the CPU kernel of torchformer::prefix_sdpa
