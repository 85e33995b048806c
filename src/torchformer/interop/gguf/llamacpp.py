"""llama.cpp (llama-cpp-python) models loaded without its extra buffer types, for the GGUF tests
and the benchmarks that compare with it.

Why: llama.cpp's extra buffer types repack weights at load for the CPU's own products, and on a
CPU with AMX that includes ggml's AMX product, which segfaults on quantized files (llama-cpp-python
0.3.36 built with GGML_NATIVE on a Xeon with amx_int8: ``ggml_backend_amx_mul_mat``). Without them
llama.cpp runs its plain CPU products (AVX-512 / VNNI here) over the file's bytes as they are. The
binding's ``Llama`` takes no argument for it and ``benchmarks/engines.py`` asks for the default
model params, so ``plain_buffers`` swaps the defaults the binding reads while a model loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def plain_buffers() -> Iterator[None]:
    """Within: ``llama_model_default_params()`` (the package's and the low-level module's, which
    ``llama_cpp.Llama`` calls) returns params with ``use_extra_bufts = False``. Not thread-safe:
    load models one at a time under it."""
    import llama_cpp
    from llama_cpp import llama_cpp as low

    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    saved = [(module, module.llama_model_default_params) for module in (llama_cpp, low)]
    for module, _ in saved:
        module.llama_model_default_params = params
    try:
        yield
    finally:
        for module, original in saved:
            module.llama_model_default_params = original
