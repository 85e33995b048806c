"""The CPU fast paths in one room: the native kernels (csrc/, built by native.py), the modules that
run products on their packed layouts (formats.py, panels.py, swapped in by scope.py) and the decode
attention kernel behind nn/'s ``prefix_sdpa`` op (attention.py, registered on import). nn/ never
imports this package: every fast path has a reference in nn/ it is tested against."""

from . import attention  # noqa: F401 - registers the CPU kernel of torchformer::prefix_sdpa
