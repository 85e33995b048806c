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

from ...configs import LinearScaling, Llama3Scaling, LongRoPE, ModelConfig, RoPE
from ...nn.rope_scaling import default_inv_freq, llama3_inv_freq
from ..hf import check_unquantized
from .archs import ARCHS, name_table, row_transforms
from .container import gguf_module
from .exportable import export_plan, writer_transforms
from .quantize import K_QUANTS, check_k_quant, k_quantize
from .vocab import tokenizer_metadata, write_tokenizer

logger = logging.getLogger(__name__)
DTYPES = ("f16", "bf16", "q8_0", "q4_0", *K_QUANTS)
FILE_TYPES = {"f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def to_gguf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: str = "f16",
    tokenizer=None,
    chat_template: str | None = None,
) -> Path:
    """Write ``model`` (a float torchformer decoder of a Llama, Mistral, Qwen2, Qwen3 or GPT-2 layout) to
    the GGUF file ``path`` with its ``tokenizer`` (a ``tokenizers.Tokenizer``: byte-level BPE, or
    `torchformer train`'s byte or char kinds; llama.cpp needs a vocabulary to load a model) and
    ``chat_template`` (Jinja text, written as tokenizer.chat_template). ``dtype``: f16, bf16, q8_0,
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
    plan = export_plan(model)
    arch, cfg = plan.arch, plan.cfg
    heads = {"num_attention_heads": cfg.attention.n_heads, "num_key_value_heads": cfg.n_kv_heads}
    gguf = gguf_module()
    writer = gguf.GGUFWriter(None, arch)
    matrices = "f16" if dtype in K_QUANTS else dtype
    _metadata(writer, cfg, FILE_TYPES[matrices])
    write_tokenizer(writer, vocab)
    table = name_table(arch, cfg.n_layers)
    redo = {**(row_transforms(arch, heads, to_gguf=True) if arch in ARCHS else {}), **writer_transforms(arch)}
    for hf_name, tensor in plan.state.items():
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        t = redo.get(name.split(".")[-2], lambda x: x)(tensor.detach().float())
        _add(writer, gguf, name, t.numpy(), matrices)
    freqs = _rope_freqs(cfg)
    if freqs is not None:  # Llama 3 scaling: per-frequency divisors as a tensor, as the converter writes it
        writer.add_tensor("rope_freqs.weight", freqs)
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


def _metadata(writer, cfg: ModelConfig, file_type: int) -> None:
    a = cfg.attention
    writer.add_name(f"torchformer {writer.arch}")
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_block_count(cfg.n_layers)
    writer.add_head_count(a.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if cfg.block.norm == "layernorm":
        writer.add_layer_norm_eps(cfg.block.norm_eps)
    else:
        writer.add_layer_norm_rms_eps(cfg.block.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)
    if isinstance(cfg.positions, RoPE):
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.positions.base)
        if isinstance(cfg.positions.scaling, LinearScaling):
            writer.add_rope_scaling_type(gguf_module().RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(cfg.positions.scaling.factor)


def _rope_freqs(cfg: ModelConfig) -> np.ndarray | None:
    """Per-frequency divisors for the schemes llama.cpp's llama graph takes as a rope_freqs tensor;
    None for plain and linear RoPE; ValueError for the rest."""
    pos = cfg.positions
    s, dim = getattr(pos, "scaling", None), cfg.head_dim
    if s is None or isinstance(s, LinearScaling):
        return None
    if isinstance(s, Llama3Scaling):
        scaled = llama3_inv_freq(dim, pos.base, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_seq_len)
        return (default_inv_freq(dim, pos.base) / scaled).float().numpy()
    if isinstance(s, LongRoPE) and s.short_factor == s.long_factor and s.attention_factor == 1.0:
        return np.asarray(s.short_factor, dtype=np.float32)
    raise ValueError(
        f"positions.scaling={type(s).__name__}: GGUF export writes plain, linear and Llama 3 RoPE scaling "
        "(and per-frequency divisors read from a GGUF file)"
    )


def _add(writer, gguf, name: str, values: np.ndarray, dtype: str) -> None:
    """One tensor: vectors F32; matrices in ``dtype`` (Q8_0 / Q4_0 need rows a multiple of 32:
    others are written f16, logged)."""
    if values.ndim < 2:
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
