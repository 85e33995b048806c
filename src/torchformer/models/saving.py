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
from safetensors import SafetensorError, safe_open
from torch import nn

from ..atomic import write_folder
from ..configs import ModelConfig
from ..fast.formats import prepare
from . import sharded
from .build import build_model
from .quantize import Quantization, quantize

CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
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


def save(
    model: nn.Module, path: str | os.PathLike, *, extra_files: dict[str, str] | None = None, force: bool = False
) -> Path:
    """Write ``model`` to folder ``path`` (created, or replaced atomically). Returns the path.

    extra_files maps file names to text content saved beside the weights (e.g. a tokenizer). An
    existing folder is replaced only when it is empty or a torchformer checkpoint (its files are
    config.json, model.safetensors, tokenizer.json and the extra files); force=True replaces any
    folder. A path that is a file is refused.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError("save needs a torchformer model (built by build_model); it has no ModelConfig")
    raw = config.to_dict()
    quantization = getattr(model, "quantization", None)
    if quantization is not None:  # the scheme rebuilds the same integer modules at load
        raw[QUANTIZATION_KEY] = quantization.to_dict()
    texts = {CONFIG_FILE: json.dumps(raw, indent=2), **(extra_files or {})}
    tensors = {WEIGHTS_FILE: unique_state(model)}
    return write_folder(path, tensors=tensors, texts=texts, replaces=(TOKENIZER_FILE,), force=force)


def one_line(err: BaseException) -> str:
    """An error's message on one line: 'head:\n  - a\n  - b' -> 'head: a; b'."""
    lines = [line.strip().removeprefix("- ") for line in str(err).splitlines() if line.strip()]
    return " ".join(lines[:1] + ["; ".join(lines[1:])] if len(lines) > 1 else lines)


def read_json(file: str | os.PathLike) -> dict:
    """A JSON file that must hold an object (config.json, a shard index); errors name the file."""
    file = Path(file)
    try:
        raw = json.loads(file.read_bytes())
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError both are
        raise ValueError(f"{file}: not a JSON file ({one_line(err)})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: must hold a JSON object of settings, got a JSON {type(raw).__name__}")
    return raw


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, Quantization | None]:
    """The ModelConfig and, for a quantized checkpoint, its quantization scheme."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a torchformer checkpoint: no {CONFIG_FILE} in it")
    raw = read_json(file)
    quantization = raw.pop(QUANTIZATION_KEY, None)
    try:
        return ModelConfig.from_dict(raw), None if quantization is None else Quantization.from_dict(quantization)
    except (ValueError, TypeError, KeyError, AttributeError) as err:  # wrong types or keys in the file
        raise ValueError(f"{file}: {one_line(err)}") from None


def load_config(path: str | os.PathLike) -> ModelConfig:
    return read_config(path)[0]


def load(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model saved in folder ``path`` by ``save``.

    The weights file's header is checked against the config before anything is built or read:
    a truncated, corrupt or foreign file, or a config that does not describe it, is one
    ValueError naming the file.
    """
    cfg, quantization = read_config(path)
    if sharded.is_sharded(path):  # a sharded (DCP) training checkpoint: its shards read as whole tensors
        model = build_meta(cfg, Path(path) / CONFIG_FILE)
        model.load_state_dict(sharded.read_whole(Path(path), unique_state(model)), strict=False, assign=True)
        return materialize(model, cfg, device)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path} has no {WEIGHTS_FILE}")
    handle = open_safetensors(weights, str(device))
    shapes = header_shapes(handle)
    check_fits(cfg, shapes, Path(path) / CONFIG_FILE, weights)
    model = build_meta(cfg, Path(path) / CONFIG_FILE)
    if quantization is not None:  # same integer modules, shapes from the meta weights
        with torch.device("meta"):
            quantize(model, quantization.scheme, group_size=quantization.group_size, lm_head=quantization.lm_head)
    expected = unique_state(model)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {weights} does not fit its config: missing {missing}, unexpected {unexpected}")
    for name, shape in shapes.items():
        if shape != tuple(expected[name].shape):
            raise ValueError(
                f"{weights}: tensor {name!r} has shape {shape}, its config expects {tuple(expected[name].shape)}"
            )
    state = {name: read_tensor(handle, name, weights) for name in shapes}
    model.load_state_dict(state, strict=False, assign=True)
    model = materialize(model, cfg, device)
    if quantization is not None:
        # The integer weights in the CPU kernels' panels where they run (fast/formats.py); the mapped
        # bytes each panel copy was made from give their pages back (read just now, written by none).
        prepare(model, release_mapped=True)
    return model


def open_safetensors(file: Path, device: str = "cpu"):
    """A lazy reader of ``file`` (the header is parsed and checked against the file's length here;
    no tensor is read). Anything that is not a whole safetensors file is a ValueError naming it."""
    try:
        return safe_open(str(file), framework="pt", device=device)
    except (SafetensorError, OSError) as err:
        why = one_line(err)
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {why}") from None


def header_shapes(handle) -> dict[str, tuple[int, ...]]:
    return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118


def load_safetensors(file: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of ``file``; a broken file is a ValueError naming it (safetensors' load_file
    raises a bare SafetensorError)."""
    handle = open_safetensors(file, device)
    return {name: read_tensor(handle, name, file) for name in header_shapes(handle)}


def read_tensor(handle, name: str, file: Path) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file}: tensor {name!r} cannot be read: {one_line(err)}") from None


def check_fits(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], config_file: Path, weights) -> None:
    """Checks of a config against a weights file's header that need no model: building 1e6 layers
    on the meta device takes minutes and a 1e9-wide one overflows, before any shape is compared.
    Layers are counted from the names (the first number in a name is its block: stack.blocks.3,
    model.layers.3, encoder.block.3); d_model and vocab_size are widths of the token table."""
    layers: dict[str, int] = {}
    for name in shapes:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if at is not None:
            prefix = ".".join(parts[:at])
            layers[prefix] = max(layers.get(prefix, 0), int(parts[at]) + 1)
    held = max(layers.values(), default=0)
    for field, value in (("n_layers", cfg.n_layers), ("n_decoder_layers", cfg.n_decoder_layers or 0)):
        if value > held:
            raise ValueError(f"{config_file}: {field}={value} but {weights} holds {held} layers; the config "
                             "does not describe these weights")  # fmt: skip
    widest = max((max(shape) for shape in shapes.values() if shape), default=0)
    for field in ("d_model", "vocab_size"):
        value = getattr(cfg, field)
        if value > widest:
            raise ValueError(f"{config_file}: {field}={value} but no tensor in {weights} is that wide (widest "
                             f"dimension {widest}); the config does not describe these weights")  # fmt: skip


def build_meta(cfg: ModelConfig, config_file) -> nn.Module:
    """The model on the meta device (no memory); sizes too large to describe are named."""
    try:
        with torch.device("meta"):
            return build_model(cfg)
    except (RuntimeError, OverflowError, MemoryError) as err:  # "Storage size calculation overflowed"
        raise ValueError(f"{config_file}: sizes too large to build a model from ({one_line(err)})") from None


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
