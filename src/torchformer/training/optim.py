"""The optimizers a recipe names (``optim.name``).

adamw: AdamW with weight decay on matrices only (Loshchilov & Hutter 2019; GPT-2/nanoGPT
practice): embeddings and projection matrices decay; biases and norm gains (1-D tensors) do not.

muon: Muon (Jordan et al. 2024, ``torch.optim.Muon``) for the hidden layers' 2-D weight matrices
(attention and MLP projections inside the stack), with AdamW for everything else: the embeddings,
the output head, norm gains and biases, which Muon's orthogonalised update does not suit (the
modded-nanogpt speedrun's split). Both live in one ``MuonAdamW`` so the schedule, the gradient
clip, the checkpoint and resume see one optimizer with one state dict. The Newton-Schulz
orthogonalisation runs in bf16 (torch's choice) where the device multiplies bf16 natively, in fp32
on CPUs that would emulate it (``Muon``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..nn.linear import cpu_bf16_units

OPTIMIZERS = ("adamw", "muon")
FUSED_DEVICES = ("cpu", "cuda", "mps")


def param_groups(params, weight_decay: float) -> list[dict]:
    """AdamW's two groups: tensors of 2+ dimensions decay, 1-D ones (biases, norm gains) do not."""
    decay, no_decay = [], []
    for p in params:
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(
    model: nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, device_type: str
) -> torch.optim.AdamW:
    groups = param_groups(trainable(model), weight_decay)
    return torch.optim.AdamW(groups, lr=lr, **_adamw_options(betas, eps, device_type))


def _adamw_options(betas, eps: float, device_type: str) -> dict:
    # The fused kernel updates every tensor in one pass: on CPU it is ~6x faster than the default
    # for-loop step (2 ms against 13 ms for the reverse recipe's 85 tensors), and HF's Trainer
    # defaults to it too. Other devices keep torch's default choice.
    return {"betas": tuple(betas), "eps": eps, "fused": (device_type in FUSED_DEVICES) or None}


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]  # .parameters() yields a tied tensor once


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """Muon's share: the trainable 2-D weights of Linear layers inside the blocks (attention and MLP
    projections), not the embeddings, the head, a tied table, norms, biases, routers, 3-D expert
    stacks or a one-row gate (a vector: nothing to orthogonalise)."""
    outside = {id(p) for name, p in model.named_parameters() if not _in_blocks(name)}  # embeddings, head, ties
    out, seen = [], set()
    for name, module in model.named_modules():
        if not (_in_blocks(name) and isinstance(module, nn.Linear)):
            continue
        p = module.weight
        if p.requires_grad and p.dim() == 2 and min(p.shape) > 1 and id(p) not in outside | seen:
            seen.add(id(p))
            out.append(p)
    return out


def _in_blocks(name: str) -> bool:
    # DecoderLM / Encoder: stack.blocks.3.attn.q_proj; EncoderDecoder: encoder.blocks.0.mlp.up, decoder.blocks...
    return "blocks" in name.split(".")


def newton_schulz_dtype(device_type: str) -> torch.dtype:
    """The dtype of Muon's orthogonalisation on ``device_type``: bf16 on accelerators and on CPUs with
    bf16 units (AVX512-BF16, AMX), fp32 on other CPUs, which emulate bf16 products by converting
    at every call: there the default recipe's Muon step took ~1.1 s at one thread (AVX2 EPYC)."""
    if device_type != "cpu" or cpu_bf16_units():
        return torch.bfloat16
    return torch.float32


def closure_loss(closure):
    """An optimizer step's loss: ``closure()`` with gradients enabled (torch's convention), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def orthogonalize(g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:  # fmt: skip
    """Muon's quintic Newton-Schulz iteration (torch.optim's, the same operations in the same order)
    in ``dtype``: g (m, n) -> an approximately semi-orthogonal (m, n) matrix in ``dtype``."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(dtype)
    x = x.T if tall else x  # (short, long): the Gram matrix is the small one
    x = x / x.norm().clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (the same groups, state and update) whose orthogonalisation runs in
    ``ns_dtype`` (``newton_schulz_dtype``); torch's always runs it in bf16. With bf16 the steps are
    torch's, bit for bit (tests/training/test_muon.py)."""

    def __init__(self, params, *, ns_dtype: torch.dtype, **options) -> None:
        super().__init__(params, **options)
        for group in self.param_groups:  # checked once here, not at every step
            if group["adjust_lr_fn"] not in (None, "original"):
                raise ValueError(f"Muon: adjust_lr_fn={group['adjust_lr_fn']!r}; this step implements 'original'")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            if self._init_group(group, params, grads, buffers):
                raise ValueError("Muon: complex parameters are not supported")
            lr, momentum = group["lr"], group["momentum"]
            for p, g, buf in zip(params, grads, buffers):
                buf.lerp_(g, 1 - momentum)
                update = g.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                rows, cols = p.shape[:2]
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * math.sqrt(max(1, rows / cols)))  # adjust_lr_fn "original"
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``matrices`` and fused ``torch.optim.AdamW`` over ``rest``, as one
    optimizer. Its param_groups are the two optimizers' own group dicts (Muon's first), so setting
    a group's lr reaches the optimizer that uses it; its state is one dict shared by both (their
    parameters are disjoint), so ``state_dict`` / ``load_state_dict`` are torch's and a checkpoint
    holds Muon's momentum buffers beside Adam's moments. Each group's ``lr_ratio`` is its lr over
    the recipe's ``optim.lr``: the schedule multiplies by it (Muon's lr is ~10x AdamW's)."""

    def __init__(self, matrices, rest, *, lr: float, muon_lr: float, momentum: float, betas, eps: float,
                 weight_decay: float, device_type: str) -> None:  # fmt: skip
        ratio = muon_lr / lr
        # adjust_lr_fn "original": lr * sqrt(max(1, rows / cols)), Keller Jordan's scaling.
        self.muon = Muon(
            [{"params": matrices, "lr_ratio": ratio}],
            lr=muon_lr,
            momentum=momentum,
            weight_decay=weight_decay,
            ns_dtype=newton_schulz_dtype(device_type),
        )
        groups = [dict(g, lr_ratio=1.0) for g in param_groups(rest, weight_decay)]
        self.adamw = torch.optim.AdamW(groups, lr=lr, **_adamw_options(betas, eps, device_type))
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._share()

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # builds new group dicts and a new state: point both at them
        self._share()


def build(model: nn.Module, optim, device_type: str) -> torch.optim.Optimizer:
    """The optimizer ``optim`` (a recipe's optim section) names, over ``model``'s trainable parameters."""
    common = {"lr": optim.lr, "betas": optim.betas, "eps": optim.eps, "weight_decay": optim.weight_decay}
    if optim.name == "adamw":
        return adamw(model, device_type=device_type, **common)
    matrices = hidden_matrices(model)
    if not matrices:
        raise ValueError("optim.name='muon': the model has no trainable 2-D weight matrix inside its blocks")
    chosen = {id(p) for p in matrices}
    rest = [p for p in trainable(model) if id(p) not in chosen]
    return MuonAdamW(matrices, rest, muon_lr=optim.muon_lr, momentum=optim.momentum, device_type=device_type, **common)
