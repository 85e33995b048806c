"""LoRA adapters (Hu et al. 2021): ``tfm.lora.apply(model, rank=8, alpha=16, targets=("q_proj", "v_proj"))``,
``tfm.lora.merge(model)``, ``tfm.lora.save(model, dir)`` (PEFT format) and ``tfm.lora.load(model, dir)``."""

from .apply import TARGET_NAMES, LoRASpec, adapter_state, adapters, apply, disabled, load_state, merge, trainable
from .layer import LoRALinear
from .peft_format import load, module_map, save

__all__ = [
    "TARGET_NAMES",
    "LoRALinear",
    "LoRASpec",
    "adapter_state",
    "adapters",
    "apply",
    "disabled",
    "load",
    "load_state",
    "merge",
    "module_map",
    "save",
    "trainable",
]
