"""Position-wise feed-forward networks: MLP (down(act(up(x)))) and GatedMLP (Shazeer 2020)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import Linear


class MLP(nn.Module):
    """FFN(x) = down(act(up(x))) (Vaswani 2017 eq. 2 with act = ReLU)."""

    def __init__(self, d_model: int, d_ff: int, act: Callable[[Tensor], Tensor], bias: bool) -> None:
        super().__init__()
        self.up = Linear(d_model, d_ff, bias=bias)
        self.down = Linear(d_ff, d_model, bias=bias)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


class _SiluTimes(torch.autograd.Function):
    """silu(g) * u keeping only g and u for backward: autograd would also keep silu(g), one more
    (B, T, d_ff) activation per layer; the backward recomputes it (an elementwise pass)."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor) -> Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, grad: Tensor):
        g, u = ctx.saved_tensors
        sig = torch.sigmoid(g)
        silu = g * sig
        # d silu / d g = sigmoid(g) (1 + g (1 - sigmoid(g))), the formula of torch's silu backward
        return grad * u * (sig * (1 + g * (1 - sig))), grad * silu


def silu_times(g: Tensor, u: Tensor) -> Tensor:
    """silu(g) * u. With no gradient recorded (inference) g, the gate's own output, is overwritten:
    two (rows, d_ff) activations fewer at a prefill's peak (16 MiB of the 1B shape's 512 rows)."""
    if not torch.is_grad_enabled():  # nothing kept for backward: no Function, no new tensors
        return F.silu(g, inplace=True).mul_(u)
    return _SiluTimes.apply(g, u)


def act_times(act: Callable[[Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """act(g) * u; with no gradient recorded the product is written over act(g)'s new tensor."""

    def product(g: Tensor, u: Tensor) -> Tensor:
        return act(g).mul_(u) if not torch.is_grad_enabled() else act(g) * u

    return product


def gated_product(act: Callable[[Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """act(g) * u, by the memory-lean SiLU form for SwiGLU (chosen once, at build time). Both
    take g and u as GatedMLP hands them: this layer's own gate and up outputs."""
    return silu_times if act is F.silu else act_times(act)


class GatedMLP(nn.Module):
    """FFN(x) = down(act(gate(x)) * up(x)): SwiGLU with act = SiLU, GeGLU with act = GELU."""

    def __init__(self, d_model: int, d_ff: int, act: Callable[[Tensor], Tensor], bias: bool) -> None:
        super().__init__()
        self.gate = Linear(d_model, d_ff, bias=bias)
        self.up = Linear(d_model, d_ff, bias=bias)
        self.down = Linear(d_ff, d_model, bias=bias)
        self.act, self.glu = act, gated_product(act)

    def gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (..., D) -> gate(x), up(x) (..., d_ff) each (fast/joint.py runs them as one product
        where the kernels' layout allows)."""
        return self.gate(x), self.up(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.glu(*self.gate_up(x)))
