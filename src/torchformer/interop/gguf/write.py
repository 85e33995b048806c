"""to_gguf: a torchformer decoder -> a GGUF file llama.cpp and Ollama run.

The reverse of read.py over the same tables: the family that fits the config (interop/hf.py's
pick_model_type) gives config.json values and Hugging Face tensor names, archs.py the GGUF
architecture and the converter's changes (llama's q/k rows permuted to the interleaved RoPE
layout llama.cpp's llama graph rotates), gguf's TensorNameMap the GGUF names. Matrices are
written in ``dtype`` (f16, bf16, or Q8_0 / Q4_0 by the gguf package's quantizers, which are
llama.cpp's round-to-nearest ones); norms and other vectors stay F32, as llama.cpp's converter
writes them. K-quants: write f16 and run llama.cpp's ``llama-quantize`` (or
``llama_cpp.llama_model_quantize``) on it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from torch import nn

from ...config import ModelConfig, RoPE
from ...models.saving import unique_state
from ...nn.rope_scaling import default_inv_freq, llama3_inv_freq
from ...rope_scaling_configs import LinearScaling, Llama3Scaling, LongRoPE
from ..hf import FAMILIES, check_unquantized, pick_model_type
from .archs import name_table, row_transforms
from .container import gguf_module
from .vocab import write_tokenizer

logger = logging.getLogger(__name__)
DTYPES = ("f16", "bf16", "q8_0", "q4_0")
FILE_TYPES = {"f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> GGUF arch


def to_gguf(model: nn.Module, path: str | os.PathLike, *, dtype: str = "f16", tokenizer=None) -> Path:
    """Write ``model`` (a float torchformer decoder of a Llama, Mistral, Qwen2 or Qwen3 layout) to
    the GGUF file ``path`` with its ``tokenizer`` (a byte-level BPE ``tokenizers.Tokenizer``; llama.cpp
    needs a vocabulary to load a model). Returns the path. Everything is checked before writing."""
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"to_gguf needs a torchformer model (built by build_model), got {type(model).__name__}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {list(DTYPES)} (K-quants: llama-quantize the f16 file)")
    if tokenizer is None:
        raise ValueError("tokenizer=None: llama.cpp loads no model without a vocabulary; pass a tokenizers.Tokenizer")
    check_unquantized(model)
    model_type = pick_model_type(cfg, None)
    if model_type not in ARCH_OF:
        raise ValueError(f"this model is a {model_type}: GGUF export writes {sorted(ARCH_OF)} layouts")
    arch = ARCH_OF[model_type]
    family = FAMILIES[model_type]
    hf, _ = family.config_to_hf(cfg, "float32")
    gguf = gguf_module()
    writer = gguf.GGUFWriter(None, arch)
    _metadata(writer, arch, cfg, hf, FILE_TYPES[dtype])
    write_tokenizer(writer, tokenizer, cfg)
    state = family.keymap(cfg).to_theirs(unique_state(model)).tensors
    table, redo = name_table(arch, cfg.n_layers), row_transforms(arch, hf, to_gguf=True)
    for hf_name, tensor in state.items():
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        t = redo.get(name.split(".")[-2], lambda x: x)(tensor.detach().float())
        _add(writer, gguf, name, t.numpy(), dtype)
    freqs = _rope_freqs(cfg)
    if freqs is not None:  # Llama 3 scaling: per-frequency divisors as a tensor, as the converter writes it
        writer.add_tensor("rope_freqs.weight", freqs)
    out = Path(path)
    tmp = out.with_name(out.name + ".partial")
    writer.write_header_to_file(tmp)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)  # a reader never sees half a file
    return out


def _metadata(writer, arch: str, cfg: ModelConfig, hf: dict, file_type: int) -> None:
    a = cfg.attention
    writer.add_name(f"torchformer {arch}")
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.block.d_ff)
    writer.add_block_count(cfg.n_layers)
    writer.add_head_count(a.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(a.head_dim)
    writer.add_value_length(a.head_dim)
    writer.add_rope_dimension_count(a.head_dim)
    writer.add_rope_freq_base(cfg.positions.base)
    writer.add_layer_norm_rms_eps(cfg.block.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)
    if isinstance(cfg.positions.scaling, LinearScaling):
        writer.add_rope_scaling_type(gguf_module().RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.positions.scaling.factor)


def _rope_freqs(cfg: ModelConfig) -> np.ndarray | None:
    """Per-frequency divisors for the schemes llama.cpp's llama graph takes as a rope_freqs tensor;
    None for plain and linear RoPE; ValueError for the rest."""
    pos: RoPE = cfg.positions
    s, dim = pos.scaling, cfg.attention.head_dim
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
