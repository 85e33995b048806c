"""PEFT-format adapters: adapter_config.json + adapter_model.safetensors, loadable by
``peft.PeftModel.from_pretrained(hf_model, folder)`` onto the transformers model ``tfm.to_hf`` writes.

PEFT names a tensor ``base_model.model.<HF module path>.lora_A.weight`` (and ``lora_B``). The HF
module path of each adapted linear comes from the family's interop key map (its weight's name on
the HF side, minus ``.weight``), so every family torchformer converts works without a table here.
A (r, K) reads the input side, which no layout transform touches; B (N, r) is the output side and
goes through the weight's own transform (e.g. the interleaved-RoPE row permutation of q and k),
checked on the spot: transform(B A) must equal transform(B) A, else the layout (a fused or
transposed on-disk tensor) has no PEFT equivalent and saving says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from ..atomic import write_folder
from .apply import adapter_state, adapters, apply, load_state

CONFIG, WEIGHTS, PREFIX = "adapter_config.json", "adapter_model.safetensors", "base_model.model."
TASK_TYPES = {"decoder": "CAUSAL_LM", "encoder": "FEATURE_EXTRACTION", "encoder_decoder": "SEQ_2_SEQ_LM"}


def _family(model: nn.Module, model_type: str | None):
    from ..interop.hf import FAMILIES, pick_model_type

    cfg = getattr(model, "config", None)
    if cfg is None:
        raise TypeError(f"a torchformer model is needed (built by build_model), got {type(model).__name__}")
    return FAMILIES[pick_model_type(cfg, model_type)].keymap(cfg)


def _hf_weight_name(keymap, ours: str, weight: Tensor) -> str:
    converted = keymap.to_theirs({f"{ours}.weight": weight})
    if len(converted.tensors) != 1 or converted.missing:
        raise ValueError(
            f"{ours}: its weight is stored fused with others on the Hugging Face side "
            f"({converted.missing or list(converted.tensors)}); PEFT has no adapter for one part"
        )
    return next(iter(converted.tensors))


def module_map(model: nn.Module, model_type: str | None = None) -> dict[str, str]:
    """Our module path -> the HF module path, for every adapted linear of ``model``."""
    keymap = _family(model, model_type)
    out = {}
    for ours, m in adapters(model).items():
        shape = (m.out_features, m.in_features)
        out[ours] = _hf_weight_name(keymap, ours, torch.empty(shape, device="meta")).removesuffix(".weight")
    return out


def _b_to_theirs(keymap, ours: str, a: Tensor, b: Tensor) -> Tensor:
    name = f"{ours}.weight"
    b_theirs = next(iter(keymap.to_theirs({name: b}).tensors.values()))
    full = next(iter(keymap.to_theirs({name: b.float() @ a.float()}).tensors.values()))
    if b_theirs.shape != b.shape or not torch.allclose(full, b_theirs.float() @ a.float(), atol=1e-6, rtol=1e-5):
        raise ValueError(
            f"{ours}: the Hugging Face layout of this weight is not a row permutation of ours "
            "(transposed or fused), so its LoRA factors have no PEFT form"
        )
    return b_theirs


def save(
    model: nn.Module, out_dir: str | os.PathLike, *, model_type: str | None = None, base_model: str | None = None
) -> Path:
    """Write the adapters of ``model`` as a PEFT LoRA adapter folder (atomically). model_type picks
    the HF family as ``tfm.to_hf`` does; base_model is recorded as base_model_name_or_path."""
    spec = getattr(model, "lora", None)
    if spec is None or not adapters(model):
        raise ValueError("this model carries no LoRA adapters: call tfm.lora.apply(model, ...) first")
    keymap, names = _family(model, model_type), module_map(model, model_type)
    state, tensors = adapter_state(model), {}
    for ours, theirs in names.items():
        a, b = state[f"{ours}.lora_A.weight"], state[f"{ours}.lora_B.weight"]
        tensors[f"{PREFIX}{theirs}.lora_A.weight"] = a.cpu().contiguous()
        tensors[f"{PREFIX}{theirs}.lora_B.weight"] = _b_to_theirs(keymap, ours, a, b).cpu().contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": TASK_TYPES[model.config.arch],
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(names.values()),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model,
    }
    return write_folder(out_dir, tensors={WEIGHTS: tensors}, texts={CONFIG: json.dumps(config, indent=2)})


def read_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG}, not a PEFT adapter folder")
    config = json.loads(path.read_text())
    problems = [
        f"{k}={config.get(k)!r}"
        for k, ok in (
            ("peft_type", config.get("peft_type") == "LORA"),
            ("use_rslora", not config.get("use_rslora")),
            ("use_dora", not config.get("use_dora")),
            ("bias", config.get("bias", "none") == "none"),
            ("fan_in_fan_out", not config.get("fan_in_fan_out")),
            ("rank_pattern", not config.get("rank_pattern")),
            ("alpha_pattern", not config.get("alpha_pattern")),
        )
        if not ok
    ]
    if problems:
        raise ValueError(
            f"{path}: unsupported settings {problems}; supported: plain LoRA (peft_type LORA, no "
            "rsLoRA/DoRA, bias none, one rank and alpha for all modules)"
        )
    return config


def load(model: nn.Module, folder: str | os.PathLike, *, model_type: str | None = None) -> nn.Module:
    """Apply the PEFT LoRA adapter in ``folder`` to ``model`` (in place) and return it."""
    config = read_config(folder)
    keymap = _family(model, model_type)
    linears = {n: m for n, m in model.named_modules() if hasattr(m, "in_features") and hasattr(m, "out_features")}
    ours_of = {}
    for name, m in linears.items():
        converted = keymap.to_theirs({f"{name}.weight": torch.empty(m.out_features, m.in_features, device="meta")})
        if len(converted.tensors) == 1 and not converted.missing:
            ours_of[next(iter(converted.tensors)).removesuffix(".weight")] = name
    tensors = load_file(str(Path(folder) / WEIGHTS))
    modules = sorted({k.removeprefix(PREFIX).rsplit(".", 2)[0] for k in tensors})
    unknown = [m for m in modules if m not in ours_of]
    if unknown:
        raise ValueError(f"{folder}: adapters for modules this model does not have: {unknown}")
    apply(
        model,
        rank=config["r"],
        alpha=config["lora_alpha"],
        dropout=config.get("lora_dropout", 0.0),
        targets=[ours_of[m] for m in modules],
    )
    state = {}
    for theirs in modules:
        ours = ours_of[theirs]
        a, b = tensors[f"{PREFIX}{theirs}.lora_A.weight"], tensors[f"{PREFIX}{theirs}.lora_B.weight"]
        state[f"{ours}.lora_A.weight"] = a
        state[f"{ours}.lora_B.weight"] = keymap.to_ours([f"{theirs}.weight"], lambda _n, b=b: b).tensors[
            f"{ours}.weight"
        ]
    load_state(model, state)
    return model
