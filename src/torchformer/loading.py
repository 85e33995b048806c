"""One entry for "a model the user names": a torchformer checkpoint folder, a Hugging Face model
folder, or a preset name. The CLI commands (generate, attention, verify, plan, convert) use it.

Models keep the dtype their weights were saved in (a bf16 folder stays bf16) unless the caller
names another; ``DTYPES`` are the names the CLI's ``--dtype`` takes.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch
from torch import nn

from . import presets
from .configs import ModelConfig
from .extras import require
from .host_memory import in_own_arena
from .models.build import build_model
from .models.saving import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    build_meta,
    load,
    load_config,
    one_line,
    open_safetensors,
    read_config,
    read_json,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def model_kind(spec: str | os.PathLike) -> str:
    """'torchformer', 'hf', 'gguf' or 'preset' for a path or name; ValueError when it is none of them."""
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():  # llama.cpp's single-file format (interop/gguf)
        return "gguf"
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
        f"model {str(spec)!r} is neither a folder (torchformer checkpoint or Hugging Face model), a .gguf file "
        "nor a preset; "
        f"presets: {presets.names()}. Hub ids are not downloaded: pass a local folder."
    )


def load_any(
    spec: str | os.PathLike,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
    group_size: int | None = None,
) -> nn.Module:
    """The model named by ``spec``; a preset is built with random weights from ``seed``. dtype None
    keeps the weights' stored dtype (a preset: float32); a dtype (or a name in DTYPES) casts the
    floating parameters to it (``cast``). quantize "int8" / "int4" (``group_size``) then quantizes
    it (``tfm.quantize``) linear by linear as it comes from the file: the float weights of a
    memory-mapped checkpoint are read once and never all held, so the process ends up holding the
    integer model (plus the float tables quantize leaves), not the float one too.

    A CPU load runs on a thread of its own (host_memory.py ``in_own_arena``): its
    temporaries stay out of the heap that generation allocates from."""
    read = functools.partial(
        _load_any, spec, seed=seed, device=device, dtype=dtype, quantize=quantize, group_size=group_size
    )
    if torch.device(device).type != "cpu":
        return read()
    # Thread-local, carried over: the serving engine loads under inference_mode (inference tensors).
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def on_loader() -> nn.Module:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return read()

    return in_own_arena(on_loader)


def _load_any(
    spec: str | os.PathLike,
    *,
    seed: int,
    device: str,
    dtype: torch.dtype | str | None,
    quantize: str | None,
    group_size: int | None,
) -> nn.Module:
    dtype = as_dtype(dtype, "dtype")
    kind = model_kind(spec)
    if quantize is not None or group_size is not None:  # every argument checked before any weight is read
        check_quantization(spec, quantize, group_size)
    if kind == "torchformer":
        model = load(spec, device=device)
    elif kind == "hf":
        from .interop import from_hf

        # Converted tensor by tensor as they are read: no full-size copy in the stored dtype.
        model = from_hf(spec, dtype=dtype).to(device).eval()
    elif kind == "gguf":
        from .interop.gguf import from_gguf

        model = from_gguf(spec, dtype=dtype or torch.float32, device=device)
    else:
        torch.manual_seed(seed)
        model = build_model(presets.get(str(spec))).to(device).eval()
    model = model if dtype is None or kind in ("hf", "gguf") else cast(model, dtype)  # those convert as they read
    if quantize is None:
        return model
    from .models.quantize import quantize as quantize_model

    # Weights freshly mapped from the file by this call: nothing wrote them, so their pages can go.
    return quantize_model(model, quantize, group_size=group_size, release_mapped=kind != "preset")


def check_quantization(spec: str | os.PathLike, scheme: str | None, group_size: int | None) -> None:
    """``tfm.quantize``'s checks of scheme and group_size against ``spec``'s shapes, on a model built
    on the meta device from its config alone (no weights read)."""
    from .models.quantize import check

    if scheme is None:
        raise ValueError(f"group_size={group_size!r} needs quantize='int4' or 'int8'")
    stored = read_config(spec)[1] if model_kind(spec) == "torchformer" else None
    if stored is not None:
        raise ValueError(f"quantize={scheme!r}: {spec} is already quantized ({stored.scheme}); load it as it is")
    check(build_meta(model_config(spec), spec), scheme, group_size, True)


def as_dtype(dtype: torch.dtype | str | None, argument: str) -> torch.dtype | None:
    """A floating torch dtype, or one from a name in DTYPES; None stays None."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{argument}={dtype!r}: must be one of {list(DTYPES)}, a floating torch.dtype or None (as stored)")


def cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its floating parameters in ``dtype``, in place (tied weights stay one tensor).
    Buffers keep their dtype, unlike ``model.to(dtype)``: the position tables (RoPE cos/sin) are
    computed in float32 and stay so, as a load leaves them, and quantized linears keep their
    float32 scales; their activations follow the input's dtype."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def check_dtype_runs(dtype: torch.dtype | None, argument: str, device: str = "cpu") -> None:
    """ValueError naming ``argument`` when this PyTorch cannot run ``dtype`` on ``device`` (some
    builds lack half-precision matmul or attention kernels on a CPU), before any weights are read."""
    if dtype is None:
        return
    try:
        x = torch.ones(1, 2, 4, 8, dtype=dtype, device=device)  # (B, H, T, E)
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        torch.nn.functional.linear(x, x[0, 0]).softmax(-1)
    except RuntimeError as err:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"{argument} {name}: this PyTorch cannot compute in {name} on {device} ({one_line(err)}); "
            f"use one of {[n for n in DTYPES if n != name]}"
        ) from None


def model_config(spec: str | os.PathLike) -> ModelConfig:
    """The config of the model ``spec`` names, from its config file alone (no weights read)."""
    kind = model_kind(spec)
    if kind == "torchformer":
        return load_config(spec)
    if kind == "hf":
        from .interop import config_from_hf

        return config_from_hf(spec)
    if kind == "gguf":
        from .interop.gguf import config_from_gguf

        return config_from_gguf(spec)
    return presets.get(str(spec))


def stored_dtype(spec: str | os.PathLike) -> torch.dtype:
    """The dtype ``load_any(spec)`` leaves the model in, without reading weights: a checkpoint's
    largest floating tensor's (from the safetensors header), the dtype a Hugging Face config.json
    names (transformers writes it; float32 when absent, its default), a preset's float32."""
    kind = model_kind(spec)
    if kind == "preset":
        return torch.get_default_dtype()
    if kind == "gguf":
        return torch.float32  # from_gguf's default: llama.cpp's CPU compute precision
    if kind == "hf":
        from .interop.hf import read_hf_config
        from .interop.hf_config import config_dtype

        return config_dtype(read_hf_config(spec)) or torch.float32
    handle = open_safetensors(Path(spec) / WEIGHTS_FILE)
    sizes = {}
    for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
        part = handle.get_slice(name)
        dtype = SAFETENSORS_DTYPES.get(part.get_dtype())
        if dtype is not None:
            sizes[dtype] = max(sizes.get(dtype, 0), math.prod(part.get_shape()))
    return max(sizes, key=sizes.get) if sizes else torch.float32


def load_tokenizer(path: str | os.PathLike):
    """The Hugging Face ``tokenizers.Tokenizer`` saved as tokenizer.json in folder ``path``, or
    rebuilt from a .gguf file's metadata."""
    if Path(path).suffix == ".gguf" and Path(path).is_file():
        from .interop.gguf.tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(path)
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {path}")
    tokenizers = require("tokenizers", extra="hf")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust side raises a bare Exception ("key must be a string at line 1 ...")
        raise ValueError(f"{file}: not a tokenizer.json the tokenizers library can read ({one_line(err)})") from None


def has_tokenizer(spec: str | os.PathLike) -> bool:
    """Whether ``load_tokenizer(spec)`` has something to read: a folder's tokenizer.json or a .gguf file."""
    path = Path(spec)
    return (path.suffix == ".gguf" and path.is_file()) or (path / TOKENIZER_FILE).is_file()
