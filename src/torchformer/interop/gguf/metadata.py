"""The ``{arch}.*`` metadata to_gguf writes, and the check that the file reads back as the model.

Keys come from two places: the ModelConfig (what every llama.cpp architecture reads: widths, heads,
norm eps, plain or linear RoPE) and the config.json the family's own table makes
(``family.config_to_hf``), through each Arch's ``fields`` backwards and the keys its graph needs
beyond them (KEYS: Gemma 3's layer pattern and two RoPE bases, the experts' counts and widths,
Phi-3's LongRoPE factors). Whether the file describes the model is then no second list of
conditions: the reader runs on what was written (archs.hf_config, which holds what each llama.cpp
graph assumes and the file leaves unsaid: Gemma 2's score scale, NeoX's exact GELU, the MoE
renormalisation, Gemma 3's unscaled sliding layers) and every setting that reads back different is
named, before a tensor is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ...configs import LinearScaling, Llama3Scaling, LongRoPE, ModelConfig, RoPE
from ...nn.rope_scaling import default_inv_freq, llama3_inv_freq, longrope_attention_factor
from ..family import differences
from ..hf import FAMILIES
from ..hf_kinds import FULL, SLIDING
from .archs import ARCHS, hf_config
from .container import GGUFFile, gguf_module


def _gemma3(cfg: ModelConfig, hf: dict) -> tuple[dict, dict]:
    """Each layer's kind as the pattern (True: sliding) and the two RoPEs: llama.cpp's gemma3 graph
    scales the full layers' RoPE only (a scaled sliding one reads back different: refused)."""
    types = hf["layer_types"]
    keys = {}
    if SLIDING in types:
        pattern = [t == SLIDING for t in types]
        keys = {"attention.sliding_window": hf["sliding_window"], "attention.sliding_window_pattern": pattern}
    full, local = hf["rope_parameters"][FULL], hf["rope_parameters"][SLIDING]
    keys.update({"rope.freq_base": full["rope_theta"], "rope.freq_base_swa": local["rope_theta"]})
    if full.get("rope_type") == "linear":
        keys.update({"rope.scaling.type": "linear", "rope.scaling.factor": full["factor"]})
    return keys, {}


def _moe(cfg: ModelConfig, hf: dict) -> tuple[dict, dict]:
    keys = {
        "expert_count": hf["num_experts"],
        "expert_used_count": hf["num_experts_per_tok"],
        "expert_feed_forward_length": hf["moe_intermediate_size"],
    }
    if hf.get("shared_expert_intermediate_size"):
        keys["expert_shared_feed_forward_length"] = hf["shared_expert_intermediate_size"]
    return keys, {}


def _phi3(cfg: ModelConfig, hf: dict) -> tuple[dict, dict]:
    """LongRoPE as the converter writes it: both factor lists as tensors, the original context and
    the attention factor (transformers' default where the config leaves it to the formula)."""
    s = getattr(cfg.positions, "scaling", None)
    if not isinstance(s, LongRoPE):
        return {}, {}
    attn = _attention_factor(cfg, s)
    keys = {"rope.scaling.original_context_length": s.original_max_seq_len, "rope.scaling.attn_factor": attn}
    tensors = {f"rope_factors_{k}.weight": np.asarray(getattr(s, f"{k}_factor"), np.float32) for k in ("long", "short")}
    return keys, tensors


def _attention_factor(cfg: ModelConfig, s: LongRoPE) -> float:
    """LongRoPE's attention factor as a number (None in the config: transformers' formula)."""
    return longrope_attention_factor(s.resolved_factor(cfg.max_seq_len), s.original_max_seq_len, s.attention_factor)


# GGUF architecture -> (cfg, config.json) -> (its keys beyond the common ones, auxiliary tensors)
KEYS: dict[str, Callable[[ModelConfig, dict], tuple[dict, dict]]] = {
    "gemma3": _gemma3,
    "qwen2moe": _moe,
    "qwen3moe": _moe,
    "phi3": _phi3,
}


def write_metadata(writer, arch: str, cfg: ModelConfig, hf: dict | None, file_type: int) -> dict[str, np.ndarray]:
    """Write the architecture's keys; return the auxiliary tensors (GGUF name -> f32 array) the
    architecture reads its RoPE from."""
    _common(writer, cfg, file_type)
    aux: dict[str, np.ndarray] = {}
    if arch in ARCHS:
        fields = {k: hf[theirs] for k, theirs in ARCHS[arch].fields.items() if hf.get(theirs) is not None}
        keys, aux = KEYS[arch](cfg, hf) if arch in KEYS else ({}, {})
        for key, value in {**fields, **keys}.items():
            if f"{arch}.{key}" not in writer.kv_data[0]:  # NeoX's layer-norm eps is already a common key
                _put(writer, f"{arch}.{key}", value)
    freqs = _rope_freqs(cfg) if arch == "llama" else None
    if freqs is not None:  # Llama 3 scaling: per-frequency divisors as a tensor, as the converter writes it
        aux["rope_freqs.weight"] = freqs
    return aux


def _put(writer, key: str, value) -> None:
    """One key in the type llama.cpp's writers give it (counts uint32)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def _common(writer, cfg: ModelConfig, file_type: int) -> None:
    a = cfg.attention
    # not the architecture's name: llama.cpp keys vocabulary fixes on general.name ("phi3" makes it
    # look up Phi-3's own special tokens, which another vocabulary lacks: the file does not load)
    writer.add_name("torchformer")
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
    if isinstance(cfg.positions, RoPE):  # Gemma 3's RoPE per layer type: its KEYS entry
        writer.add_rope_dimension_count(cfg.positions.rotary_dim(cfg.head_dim))
        writer.add_rope_freq_base(cfg.positions.base)
        if isinstance(cfg.positions.scaling, LinearScaling):
            writer.add_rope_scaling_type(gguf_module().RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(cfg.positions.scaling.factor)


def _rope_freqs(cfg: ModelConfig) -> np.ndarray | None:
    """Llama 3 scaling as llama.cpp's llama graph takes it: per-frequency divisors (None for others)."""
    pos = cfg.positions
    s, dim = getattr(pos, "scaling", None), cfg.head_dim
    if isinstance(s, Llama3Scaling):
        scaled = llama3_inv_freq(dim, pos.base, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_seq_len)
        return (default_inv_freq(dim, pos.base) / scaled).float().numpy()
    if isinstance(s, LongRoPE) and s.short_factor == s.long_factor and s.attention_factor == 1.0:
        return np.asarray(s.short_factor, dtype=np.float32)  # a table read from a GGUF file, written back
    return None


def check_reads_back(writer, arch: str, shapes: dict[str, tuple[int, ...]], aux: dict, cfg: ModelConfig) -> None:
    """ValueError naming every setting the written metadata and tensors read back different from
    ``cfg`` (archs.hf_config -> the family's config_from_hf), i.e. where llama.cpp would run another
    model. ``shapes``: GGUF name -> PyTorch-order shape of every tensor to be written."""
    if arch not in ARCHS:
        return  # gpt2: written for llama.cpp, which the file was made for; torchformer reads no gpt2 GGUF
    meta = {k: _plain(v, gguf_module()) for k, v in writer.kv_data[0].items()}
    headers = {n: SimpleNamespace(shape=tuple(reversed(s)), data=aux.get(n)) for n, s in shapes.items()}
    f = GGUFFile(Path(f"<GGUF {arch}>"), meta, headers)
    try:
        hf = hf_config(f)
        family = FAMILIES[hf["model_type"]]
        back = family.config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"this model cannot be written as GGUF {arch}: its metadata does not read back ({err})"
        ) from None
    pos, again = cfg.positions, back.positions
    if isinstance(pos, RoPE) and isinstance(again, RoPE):
        if pos.pairing in family.pairings:  # the key map converts the pairing; the file has one layout
            again = dataclasses.replace(again, pairing=pos.pairing)
        if isinstance(pos.scaling, Llama3Scaling) and "rope_freqs.weight" in aux:
            again = pos  # its divisors, computed from it above (read back as a per-frequency table)
        if isinstance(pos.scaling, LongRoPE) and pos.scaling.attention_factor is None:  # written as its value
            given = dataclasses.replace(pos.scaling, attention_factor=_attention_factor(cfg, pos.scaling))
            again = pos if again == dataclasses.replace(pos, scaling=given) else again
        back = back.replace(positions=again)
    problems = differences(cfg, back, f"GGUF {arch}")
    if problems:
        raise ValueError(
            f"this model cannot be written as GGUF {arch} (llama.cpp's {arch} graph would run another model): "
            + "; ".join(problems)
        )


def _plain(value, gguf):
    """A written key's value as open_gguf reads it (float32 scalars as their shortest decimal)."""
    if value.type == gguf.GGUFValueType.FLOAT32:
        return float(str(np.float32(value.value)))
    return value.value
