"""Position-wise feed-forward networks: MLP (down(act(up(x)))) and GatedMLP (Shazeer 2020)."""

from __future__ import annotations

from collections.abc import Callable

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


class GatedMLP(nn.Module):
    """FFN(x) = down(act(gate(x)) * up(x)): SwiGLU with act = SiLU, GeGLU with act = GELU."""

    def __init__(self, d_model: int, d_ff: int, act: Callable[[Tensor], Tensor], bias: bool) -> None:
        super().__init__()
        self.gate = Linear(d_model, d_ff, bias=bias)
        self.up = Linear(d_model, d_ff, bias=bias)
        self.down = Linear(d_ff, d_model, bias=bias)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))
