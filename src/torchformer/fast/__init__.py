"""The CPU fast paths in one room: the native kernels (csrc/, built by native.py) and the modules
that run products on their packed layouts. Nothing in nn/ depends on this package for
correctness: every fast product has a reference in nn/ it is tested against."""
