"""Which llama.cpp architecture writes a torchformer decoder, and the tensors it writes.

The Hugging Face family that fits the config (interop/hf.py's pick_model_type) names the layout
and, through its key map, the HF tensor names gguf's TensorNameMap turns into GGUF ones. One
layout needs more than a rename:

- ``gpt2``: llama.cpp's gpt2 graph requires every bias, and `torchformer train`'s default
  (shakespeare-char) trains attention without them. Zero biases compute the same function, so a
  model that is GPT-2 but for its missing biases is written with zero ones. HF's GPT-2 keeps
  OpenAI's Conv1D (in, out) matrices: they are transposed back to llama.cpp's (out, in).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ...configs import ModelConfig
from ...models.saving import build_meta, unique_state
from ..hf import FAMILIES, pick_model_type

# model_type -> GGUF architecture
ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # gpt2's matrices HF stores (in, out)


@dataclasses.dataclass(frozen=True)
class Export:
    arch: str  # the GGUF architecture
    cfg: ModelConfig  # the config written (gpt2: with the zero biases)
    state: dict[str, Tensor]  # Hugging Face name -> tensor


def export_plan(model: nn.Module) -> Export:
    """The architecture and HF-named tensors ``model`` is written with; ValueError naming the
    layouts when none fits."""
    cfg: ModelConfig = model.config
    state = unique_state(model)
    try:
        model_type = pick_model_type(cfg, None)
    except ValueError:
        model_type, cfg, state = _zero_biased(cfg, state)
    if model_type not in ARCH_OF:
        raise ValueError(f"this model is a {model_type}: GGUF export writes {sorted(ARCH_OF)} layouts")
    return Export(ARCH_OF[model_type], cfg, FAMILIES[model_type].keymap(cfg).to_theirs(state).tensors)


def _zero_biased(cfg: ModelConfig, state: dict[str, Tensor]):
    """GPT-2 with zero biases where ``cfg`` has none; the original error when that is no GPT-2 either."""
    biased = cfg.replace(
        attention=dataclasses.replace(cfg.attention, bias=True, out_bias=None),
        block=dataclasses.replace(cfg.block, bias=True),
    )
    if not _is_gpt2(biased):
        pick_model_type(cfg, None)  # raises, naming why each family does not fit
    dtype = next(iter(state.values())).dtype
    meta = unique_state(build_meta(biased, "<to_gguf>"))
    return "gpt2", biased, {k: state[k] if k in state else torch.zeros(t.shape, dtype=dtype) for k, t in meta.items()}


def _is_gpt2(cfg: ModelConfig) -> bool:
    try:
        return pick_model_type(cfg, None) == "gpt2"
    except ValueError:
        return False


def writer_transforms(arch: str) -> dict:
    """GGUF tensor kind -> the change made on the way out, beyond archs.row_transforms."""
    if arch != "gpt2":
        return {}
    return {leaf: (lambda t: t.t() if t.dim() == 2 else t) for leaf in CONV1D}
