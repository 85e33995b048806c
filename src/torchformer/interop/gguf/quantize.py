"""K-quant GGUF files (Q4_K_M and the rest) by llama.cpp's own quantizer, through llama-cpp-python.

K-quant blocks (256 inputs, nested 6-bit scales) are chosen by a search over scales and, in the
_M/_S mixes, a per-tensor choice of types (attn_v and ffn_down get more bits in Q4_K_M); the
``gguf`` package has no quantizer for them, and files people share come from llama.cpp's
``llama-quantize``. to_gguf writes the f16 file and calls the same function (``llama_model_quantize``)
here; tensors whose rows are not whole 256-blocks get llama.cpp's own fallback type.
"""

from __future__ import annotations

import ctypes
import importlib
from pathlib import Path

# to_gguf's dtype -> the suffix of llama.cpp's LLAMA_FTYPE_MOSTLY_* it names.
K_QUANTS = {"q4_k_m": "Q4_K_M", "q4_k_s": "Q4_K_S", "q5_k_m": "Q5_K_M", "q5_k_s": "Q5_K_S", "q6_k": "Q6_K",
            "q3_k_m": "Q3_K_M", "q2_k": "Q2_K"}  # fmt: skip


def _llama_cpp(dtype: str):
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        raise ValueError(
            f"dtype={dtype!r}: K-quants are made by llama.cpp's quantizer, which needs llama-cpp-python "
            "(pip install 'torchformer[engines]'); or write dtype='f16' and run llama.cpp's llama-quantize on it"
        ) from None


def check_k_quant(dtype: str) -> None:
    """Before any writing: the quantizer is importable."""
    _llama_cpp(dtype)


def k_quantize(source: Path, out: Path, dtype: str) -> None:
    """Quantize the f16 GGUF ``source`` to ``out`` (written beside it and renamed into place)."""
    llama_cpp = _llama_cpp(dtype)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{K_QUANTS[dtype]}")
    tmp = out.with_name(out.name + ".quantizing")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if status != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's llama_model_quantize returned {status} for {dtype} (its log says why)")
    tmp.replace(out)
