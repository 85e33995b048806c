"""to_gguf: a torchformer decoder -> a GGUF file llama.cpp and Ollama run.

The reverse of read.py over the same tables: exportable.py picks the architecture and gives the
Hugging Face tensor names (through the family's key map), archs.py the converter's changes
(llama's q/k rows permuted to the interleaved RoPE layout llama.cpp's llama graph rotates),
gguf's TensorNameMap the GGUF names. Matrices are written in ``dtype`` (f16, bf16, or Q8_0 /
Q4_0 by the gguf package's quantizers, which are llama.cpp's round-to-nearest ones); norms and
other vectors stay F32, as llama.cpp's converter writes them. K-quants (q4_k_m, ...) are written
f16 first and quantized by llama.cpp's own ``llama_model_quantize`` through llama-cpp-python
(quantize.py): K-quant blocks are chosen by a search only llama.cpp implements, and it is the
tool those files come from.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from torch import nn

from ...configs import ModelConfig
from ..hf import check_unquantized
from .container import gguf_module
from .exportable import export_plans, gguf_tensors, shapes
from .metadata import check_reads_back, write_metadata
from .quantize import K_QUANTS, check_k_quant, k_quantize
from .vocab import tokenizer_metadata, write_tokenizer

logger = logging.getLogger(__name__)
DTYPES = ("f16", "bf16", "q8_0", "q4_0", *K_QUANTS)
FILE_TYPES = {"f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def to_gguf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: str = "f16",
    tokenizer=None,
    chat_template: str | None = None,
) -> Path:
    """Write ``model`` (a float torchformer decoder of a layout llama.cpp runs: Llama, Mistral, Qwen2,
    Qwen3, Gemma 1-3, Phi-3, OLMo 2, GPT-NeoX, Qwen2-MoE, Qwen3-MoE or GPT-2) to the GGUF file
    ``path`` with its ``tokenizer`` (a ``tokenizers.Tokenizer``: byte-level BPE, or `torchformer
    train`'s byte or char kinds; llama.cpp needs a vocabulary to load a model) and
    ``chat_template`` (Jinja text, written as tokenizer.chat_template). A model whose file llama.cpp
    would run as another model (a setting its graph fixes otherwise) is refused, naming it. ``dtype``: f16, bf16, q8_0,
    q4_0, or a K-quant (q4_k_m, ...: needs llama-cpp-python). Returns the path. Everything is
    checked before writing."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"to_gguf needs a torchformer model (built by build_model), got {type(model).__name__}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {list(DTYPES)}")
    if tokenizer is None:
        raise ValueError("tokenizer=None: llama.cpp loads no model without a vocabulary; pass a tokenizers.Tokenizer")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template={chat_template!r}: must be the template's Jinja text or None")
    if dtype in K_QUANTS:
        check_k_quant(dtype)
    check_unquantized(model)
    vocab = tokenizer_metadata(tokenizer, cfg, chat_template)
    gguf = gguf_module()
    matrices = "f16" if dtype in K_QUANTS else dtype
    refusals = []
    for plan in export_plans(model):
        writer = gguf.GGUFWriter(None, plan.arch)
        aux = write_metadata(writer, plan.arch, plan.cfg, plan.hf, FILE_TYPES[matrices])
        try:  # the metadata and tensor names, read back, are this model: else the next layout
            check_reads_back(writer, plan.arch, {**shapes(plan), **{n: a.shape for n, a in aux.items()}}, aux, plan.cfg)
            break
        except ValueError as err:
            refusals.append(str(err))
    else:
        raise ValueError("\n".join(refusals))
    tensors = gguf_tensors(plan)
    write_tokenizer(writer, vocab)
    for name, t in tensors.items():
        _add(writer, gguf, name, t.numpy(), matrices)
    for name, values in aux.items():  # RoPE tables: f32, as the converter writes them
        writer.add_tensor(name, values)
    out = Path(path)
    tmp = out.with_name(out.name + ".partial")
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if dtype in K_QUANTS:
        k_quantize(tmp, out, dtype)  # f16 -> the K-quant, written beside and renamed into place
        tmp.unlink()
    else:
        tmp.replace(out)  # a reader never sees half a file
    return out


def _add(writer, gguf, name: str, values: np.ndarray, dtype: str) -> None:
    """One tensor: vectors and MoE routers F32 (llama.cpp's quantizer leaves routers so); matrices in
    ``dtype`` (Q8_0 / Q4_0 need rows a multiple of 32: others are written f16, logged)."""
    if values.ndim < 2 or name.endswith(ROUTERS):
        writer.add_tensor(name, values.astype(np.float32))
        return
    if dtype == "f16":
        writer.add_tensor(name, values.astype(np.float16))
        return
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0}[dtype]  # fmt: skip
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if values.shape[-1] % block:
        logger.info("%s: rows of %d are not whole %s blocks of %d; written f16", name, values.shape[-1], dtype, block)
        writer.add_tensor(name, values.astype(np.float16))
        return
    writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
