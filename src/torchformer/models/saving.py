"""Native checkpoints: a folder with config.json and model.safetensors (no pickle anywhere).

A quantized model (``tfm.quantize``) saves its integer weights and scales as tensors and the
scheme as config.json's "quantization" entry; ``load`` rebuilds the same modules from it.

Writes go to a temporary folder that is renamed into place, so an interrupted save never leaves
a half-written checkpoint where a good one was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..atomic import write_folder
from ..config import ModelConfig
from .build import build_model
from .quantize import Quantization, quantize

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
QUANTIZATION_KEY = "quantization"  # config.json entry of a quantized model (tfm.quantize)


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with tied tensors stored once (safetensors refuses shared storage)."""
    # Tied parameters are the same object; data_ptr() cannot tell them apart on the meta device,
    # where every tensor reports 0.
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out[name] = tensor.detach().contiguous()
    return out


def save(model: nn.Module, path: str | os.PathLike, *, extra_files: dict[str, str] | None = None) -> Path:
    """Write ``model`` to folder ``path`` (created or replaced atomically). Returns the path.

    extra_files maps file names to text content saved beside the weights (e.g. a tokenizer).
    """
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError("save needs a torchformer model (built by build_model); it has no ModelConfig")
    raw = config.to_dict()
    quantization = getattr(model, "quantization", None)
    if quantization is not None:  # the scheme rebuilds the same integer modules at load
        raw[QUANTIZATION_KEY] = quantization.to_dict()
    texts = {CONFIG_FILE: json.dumps(raw, indent=2), **(extra_files or {})}
    return write_folder(path, tensors={WEIGHTS_FILE: unique_state(model)}, texts=texts)


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, Quantization | None]:
    """The ModelConfig and, for a quantized checkpoint, its quantization scheme."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a torchformer checkpoint: no {CONFIG_FILE} in it")
    raw = json.loads((path / CONFIG_FILE).read_text())
    quantization = raw.pop(QUANTIZATION_KEY, None)
    return ModelConfig.from_dict(raw), None if quantization is None else Quantization.from_dict(quantization)


def load_config(path: str | os.PathLike) -> ModelConfig:
    return read_config(path)[0]


def load(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model saved in folder ``path`` by ``save``."""
    cfg, quantization = read_config(path)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path} has no {WEIGHTS_FILE}")
    state = load_file(str(weights), device=str(device))
    with torch.device("meta"):
        model = build_model(cfg)
        if quantization is not None:  # same integer modules, shapes from the meta weights
            quantize(model, quantization.scheme, group_size=quantization.group_size, lm_head=quantization.lm_head)
    expected = unique_state(model)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {weights} does not fit its config: missing {missing}, unexpected {unexpected}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, config expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    return materialize(model, cfg, device)


def materialize(model: nn.Module, cfg: ModelConfig, device) -> nn.Module:
    """After a meta-device build and load_state_dict(assign=True): re-tie the output head and
    recompute the derived buffers (position tables) on the real device."""
    if cfg.tie_embeddings and isinstance(
        getattr(model, "lm_head", None), nn.Linear
    ):  # a quantized head is its own copy
        tok = model.tgt_embed.tok if hasattr(model, "tgt_embed") else model.embed.tok
        model.lm_head.weight = tok.weight
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(torch.device(device))
    return model.eval()
