"""apply / merge / the adapter tensors, by module name.

Targets name modules by the end of their path: "q_proj" is every attention query projection,
"mlp.up" every MLP up projection, "lm_head" the output head (DESIGN section 6 names). A target
that matches no linear module is an error listing the names there are.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..nn.quant import QuantLinear
from .layer import FrozenQuantized, LoRALinear

TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.up", "mlp.gate", "mlp.down", "lm_head")


@dataclass(frozen=True)
class LoRASpec:
    """What ``apply`` did: saved beside the adapter tensors so they can be applied again."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            problems.append(f"rank={self.rank!r}: must be an integer >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            problems.append(f"alpha={self.alpha!r}: must be a number > 0")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            problems.append(f"dropout={self.dropout!r}: must be a number in [0, 1)")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) for t in targets):
            problems.append(f"targets={self.targets!r}: must be a non-empty list of module names, e.g. {TARGET_NAMES}")
        if problems:
            raise ValueError("invalid LoRA settings:\n  - " + "\n  - ".join(problems))
        object.__setattr__(self, "targets", tuple(targets))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """The LoRA-wrapped modules of ``model`` by module path."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def apply(
    model: nn.Module, rank: int = 8, alpha: float = 16.0, targets=("q_proj", "v_proj"), dropout: float = 0.0
) -> nn.Module:
    """Wrap every linear named by ``targets`` in a LoRALinear (in place) and freeze everything
    else: afterwards only the adapters' A and B require gradients. Returns ``model``."""
    spec = LoRASpec(rank=rank, alpha=alpha, dropout=dropout, targets=targets)
    if adapters(model):
        raise ValueError("this model already carries LoRA adapters: merge them (tfm.lora.merge) before applying more")
    linears = _linears(model)
    chosen = {}
    for target in spec.targets:
        hits = [(n, m) for n, m in linears if _matches(n, target)]
        if not hits:
            names = sorted({re.sub(r"\.\d+\.", ".{i}.", n) for n, _ in linears})
            raise ValueError(
                f"LoRA target {target!r} matches no linear module; this model's linear modules are (per block): {names}"
            )
        chosen.update(hits)
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    if tied and "lm_head" in chosen:
        raise ValueError(
            "LoRA target 'lm_head': this model ties lm_head to the token embedding (tie_embeddings=true), so "
            "a merged update would change the embedding too; leave lm_head out of the targets"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, lin in chosen.items():
        _set(model, name, LoRALinear(lin, spec.rank, spec.alpha, spec.dropout))
    for name, lin in linears:  # QLoRA: the int8 / int4 layers left out stay frozen in eval mode
        if name not in chosen and isinstance(lin, QuantLinear):
            _set(model, name, FrozenQuantized(lin))
    model.lora = spec  # read by save() and by training checkpoints
    return model


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W + alpha/r * B A) and unwrap it: the model is
    plain again (tfm.save / tfm.to_hf write it as any other). Parameters become trainable again."""
    found = adapters(model)
    quantized = [n for n, m in found.items() if not isinstance(m.base_layer, nn.Linear)]
    if quantized:
        raise ValueError(
            f"cannot merge LoRA into quantized base layers {quantized}: merge into the float model "
            "(apply the same adapters to it with tfm.lora.load_state), then quantize"
        )
    for name, m in found.items():
        base = m.base_layer
        base.weight += m.delta().to(base.weight.dtype)
        _set(model, name, base)
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, FrozenQuantized)]:
        _set(model, name, m.base_layer)
    for p in model.parameters():
        p.requires_grad_(True)
    if hasattr(model, "lora"):
        del model.lora
    return model


@contextlib.contextmanager
def disabled(model: nn.Module):
    """The base model alone inside the block: every adapter is swapped for its base layer and put
    back on exit, so the forward is exactly the frozen base's (DPO's reference with LoRA, as PEFT's
    ``disable_adapter``: no second copy of the weights). Nothing else changes; the mode is the caller's."""
    found = adapters(model)
    for name, m in found.items():
        _set(model, name, m.base_layer)
    try:
        yield model
    finally:
        for name, m in found.items():
            _set(model, name, m)


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter tensors under torchformer names: "<module path>.lora_A.weight" / ".lora_B.weight"."""
    out = {}
    for name, m in adapters(model).items():
        out[f"{name}.lora_A.weight"] = m.lora_A.weight.detach().contiguous()
        out[f"{name}.lora_B.weight"] = m.lora_B.weight.detach().contiguous()
    return out


@torch.no_grad()
def load_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy adapter tensors (``adapter_state``'s names) into a model that carries the same adapters."""
    expected = adapter_state(model)
    if set(state) != set(expected):
        raise ValueError(
            f"adapter tensors do not fit the model: missing {sorted(set(expected) - set(state))}, "
            f"unexpected {sorted(set(state) - set(expected))}"
        )
    bad = [k for k in state if tuple(state[k].shape) != tuple(expected[k].shape)]
    if bad:
        raise ValueError(
            f"adapter tensors {bad} have shapes {[tuple(state[k].shape) for k in bad]}, "
            f"the model's adapters {[tuple(expected[k].shape) for k in bad]}"
        )
    for key, value in state.items():
        expected[key].copy_(value)  # detach() shares storage with the parameter


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
