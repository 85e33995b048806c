"""Reading and writing Hugging Face config.json values that several families share."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..configs import ModelConfig

# HF activation names (transformers' ACT2FN keys) -> our block.mlp words.
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
# Our word -> the HF name written on export.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
# The count and width keys of the supported families' config.json files: each must be an integer.
SIZE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "type_vocab_size",
    "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "n_ctx",  # GPT-2
    "d_model", "d_ff", "d_kv", "num_layers", "num_decoder_layers", "num_heads",  # T5
    "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "encoder_ffn_dim", "decoder_ffn_dim",  # BART, Marian
    "dim", "hidden_dim", "n_layers", "n_heads",  # DistilBERT
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",  # DeepSeek
)  # fmt: skip


def check_sizes(hf: dict[str, Any], file) -> None:
    """Sizes of the wrong type ("4" for num_hidden_layers) or sign are named before any family
    reads them: multiplied deep inside a family's code they fail with a message about str * int."""
    for key in SIZE_KEYS:
        value = hf.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{file}: {key}={value!r} must be a non-negative integer")


def unsupported(model_type: str, problems: list[str]) -> None:
    """One ValueError naming every setting this loader cannot reproduce exactly."""
    if problems:
        lines = "\n  - ".join(problems)
        raise ValueError(f"{model_type} config has settings torchformer does not support:\n  - {lines}")


def config_dtype(hf: dict[str, Any]) -> torch.dtype | None:
    """The dtype config.json names: ``dtype`` (transformers 5) or ``torch_dtype`` (4.x)."""
    name = hf.get("dtype") or hf.get("torch_dtype")
    if name is None:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json dtype={name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


def token_ids(hf: dict[str, Any], vocab_size: int) -> dict[str, int | None]:
    """Special token ids that fit the vocabulary; a list (Llama 3's eos) keeps its first entry."""
    out: dict[str, int | None] = {}
    for name in TOKEN_FIELDS:
        value = hf.get(name)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None and not (isinstance(value, int) and 0 <= value < vocab_size):
            warnings.warn(
                f"config.json {name}={value!r} is outside [0, vocab_size={vocab_size}); dropped", stacklevel=3
            )
            value = None
        out[name] = value
    return out


def token_fields(cfg: ModelConfig, names: tuple[str, ...] = TOKEN_FIELDS[:3]) -> dict[str, int]:
    """The ids that are set; unset ones are left out so transformers keeps its defaults."""
    return {name: getattr(cfg, name) for name in names if getattr(cfg, name) is not None}
