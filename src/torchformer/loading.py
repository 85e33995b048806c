"""One entry for "a model the user names": a torchformer checkpoint folder, a Hugging Face model
folder, or a preset name. The CLI commands (generate, attention, verify, plan, convert) use it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from . import presets
from .extras import require
from .models.build import build_model
from .models.saving import CONFIG_FILE, TOKENIZER_FILE, load, one_line, read_json


def model_kind(spec: str | os.PathLike) -> str:
    """'torchformer', 'hf' or 'preset' for a path or name; ValueError when it is none of them."""
    path = Path(spec)
    if path.is_dir():
        config = path / CONFIG_FILE
        if not config.is_file():
            raise ValueError(
                f"{path} has no {CONFIG_FILE}: not a torchformer checkpoint nor a Hugging Face model folder"
            )
        return "hf" if "model_type" in read_json(config) else "torchformer"
    if str(spec) in presets.names():
        return "preset"
    raise ValueError(
        f"model {str(spec)!r} is neither a folder (torchformer checkpoint or Hugging Face model) nor a preset; "
        f"presets: {presets.names()}. Hub ids are not downloaded: pass a local folder."
    )


def load_any(spec: str | os.PathLike, *, seed: int = 0, device: str = "cpu") -> nn.Module:
    """The model named by ``spec``; a preset is built with random weights from ``seed``."""
    kind = model_kind(spec)
    if kind == "torchformer":
        return load(spec, device=device)
    if kind == "hf":
        from .interop import from_hf

        return from_hf(spec).to(device).eval()
    torch.manual_seed(seed)
    return build_model(presets.get(str(spec))).to(device).eval()


def load_tokenizer(path: str | os.PathLike):
    """The Hugging Face ``tokenizers.Tokenizer`` saved as tokenizer.json in folder ``path``."""
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {path}")
    tokenizers = require("tokenizers", extra="hf")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust side raises a bare Exception ("key must be a string at line 1 ...")
        raise ValueError(f"{file}: not a tokenizer.json the tokenizers library can read ({one_line(err)})") from None
