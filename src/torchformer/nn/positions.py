"""Position schemes. Absolute ones return a (B, T, D) term added to the embeddings, RoPE returns
(cos, sin) rows for the attention to rotate q and k with, ALiBi and relative bias return an
additive (B, H, T, S) score bias. All are indexed by per-row positions (B, T), so left-padded
rows and cached decoding see the same values as an unpadded full forward. The two score biases
are defined once as rules of (b, h, q_idx, kv_idx) (``rule``, see nn/patterns.py): their dense
``forward`` evaluates that rule on index grids and flex calls it inside the kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .patterns import Rule, dense_bias


def default_inv_freq(dim: int, base: float) -> Tensor:
    """base^(-2i/dim) for i < dim/2 (Su et al. 2021), in float64 on the CPU.  -> (dim/2,)

    Derived tables are computed on the CPU and then placed: building them directly on the meta
    device (count_params, load) routes arange through torch._refs, which imports torch._dynamo
    (~5 s the first time in a process)."""
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)


def position_angles(n_pos: int, dim: int, base: float) -> Tensor:
    """pos * base^(-2i/dim) for pos < n_pos, i < dim/2, in float64 on the CPU.  -> (N, dim/2)"""
    return torch.arange(n_pos, dtype=torch.float64, device="cpu")[:, None] * default_inv_freq(dim, base)


def placed(table: Tensor, device: torch.device | None) -> Tensor:
    """table on ``device``, or on the default device (which a ``with torch.device(...)`` sets)."""
    return table.to(torch.get_default_device() if device is None else device)


def interleave_sin_cos(angles: Tensor) -> Tensor:
    """sin at even, cos at odd features (the paper).  (N, D/2) -> (N, D)"""
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # (N, D)


def split_sin_cos(angles: Tensor) -> Tensor:
    """All sines, then all cosines (tensor2tensor, Marian).  (N, D/2) -> (N, D)"""
    return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (N, D)


def sinusoid_table(n_pos: int, dim: int, base: float, layout: Callable[[Tensor], Tensor]) -> Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/D)), PE(pos, 2i+1) = cos(...) (Vaswani 2017, 3.5).

    layout places the sines and cosines (``interleave_sin_cos`` or ``split_sin_cos``; build.py
    maps the config word to one). Returns (n_pos, dim) in fp32.
    """
    angles = position_angles(n_pos, dim, base)  # (N, D/2)
    return layout(angles).float()


class SinusoidalPositions(nn.Module):
    def __init__(self, max_len: int, dim: int, base: float, layout: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.args = (max_len, dim, base, layout)
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the table; not persistent, as it follows from the config."""
        self.register_buffer("table", placed(sinusoid_table(*self.args), device), persistent=False)

    def forward(self, pos: Tensor) -> Tensor:  # (B, T) -> (B, T, D)
        return self.table[pos]


class LearnedPositions(nn.Module):
    def __init__(self, max_len: int, dim: int, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(max_len + offset, dim))
        if not self.weight.is_meta:  # meta normal_ imports torch._dynamo (~5 s); no values anyway
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, pos: Tensor) -> Tensor:  # (B, T) -> (B, T, D)
        return self.weight[pos + self.offset]


class RotaryTable(nn.Module):
    """cos/sin of pos * inv_freq for the positions asked: (B, 1, T, E/2) each.

    inv_freq None is plain RoPE, base^(-2i/E) for i < E/2; a static scaled RoPE passes its
    (E/2,) float64 frequencies (nn/rope_scaling.py) and attention factor, which multiplies cos
    and sin as in transformers (YaRN, LongRoPE), so the scores scale by its square.

    Computed per forward in float64, then rounded to fp32: the values a float64 table of every
    position would hold, without the table (max_len x E/2 x 2 fp32 values: 32 MiB resident for
    Llama 3's 131072 positions, ~10% of the 1B shape's memory beyond its weights). A forward
    computes B x T x E/2 of them, a step B x E/2.
    """

    def __init__(
        self, head_dim: int, base: float, *, inv_freq: Tensor | None = None, attention_factor: float = 1.0
    ) -> None:
        super().__init__()
        self.given, self.factor = (head_dim, base, inv_freq), attention_factor
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | None = None) -> None:
        head_dim, base, inv_freq = self.given
        if inv_freq is None:
            inv_freq = default_inv_freq(head_dim, base)  # (E/2,)
        self.register_buffer("inv_freq", placed(inv_freq.double(), device), persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves follow ``fn``; a cast (``model.to(torch.bfloat16)``, ``.half()``) does not: the
        frequencies are made again in float64 where ``fn`` put them. Rounded to bf16 (8 bits) they
        would be off by up to 1/512 of themselves, the angle at position 1000 by up to ~2 radians."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float64:
            self.reset_buffers(self.inv_freq.device)
        return self

    def forward(self, pos: Tensor) -> tuple[Tensor, Tensor]:  # (B, T) -> (B, 1, T, E/2) each
        angles = pos[:, None, :, None].double() * self.inv_freq  # (B, 1, T, E/2)
        return (angles.cos() * self.factor).float(), (angles.sin() * self.factor).float()


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate feature pairs (i, i + E/2) by the position angle (HF Llama's layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, T, E/2) each
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate feature pairs (2i, 2i + 1) by the position angle (Meta's original layout)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, H, T, E/2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def rotate_partial(x: Tensor, cos: Tensor, sin: Tensor, *, dim: int, rotate: Callable) -> Tensor:
    """Rotate the first ``dim`` features of each head with ``rotate`` and pass the rest through
    (partial rotary: GPT-NeoX rotary_pct, GPT-J rotary_dim, Phi-4-mini partial_rotary_factor)."""
    return torch.cat([rotate(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)  # (B, H, T, E)


def alibi_slopes(n_heads: int) -> Tensor:
    """Geometric slopes 2^(-8/n), 2^(-16/n), ...; for n not a power of two, the closest power's
    slopes plus every other slope of the next power (Press et al. 2022, their reference code)."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device="cpu")


class ALiBiBias(nn.Module):
    """bias[h, i, j] = -slope_h * |pos_i - pos_j| (for causal models only j <= i is ever used)."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.params: tuple[Tensor, ...] = ()  # nothing learned
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | None = None) -> None:
        self.register_buffer("slopes", placed(alibi_slopes(self.n_heads), device), persistent=False)  # (H,)

    def rule(self, q_pos: Tensor, k_pos: Tensor) -> Rule:
        """Positions (B, T), (B, S) -> the bias of (b, h, q, kv)."""
        slopes = self.slopes
        return lambda b, h, q, kv: -slopes[h] * (q_pos[b, q] - k_pos[b, kv]).abs()

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:  # (B, T), (B, S) -> (B, H, T, S)
        return dense_bias(self.rule(q_pos, k_pos), q_pos.shape[0], self.n_heads, q_pos.shape[1], k_pos.shape[1],
                          q_pos.device)  # fmt: skip


class RelativePositionBias(nn.Module):
    """T5's learned bias: relative distance -> log-spaced bucket -> one scalar per head.

    Half the buckets are exact small distances, the rest grow logarithmically up to
    max_distance. Bidirectional models spend half the buckets on each direction. The bucket of
    every relative distance in [-max_len, max_len] is computed once into a table, so the rule
    (and flex's score_mod) is two lookups, bit-identical wherever it is evaluated.
    """

    def __init__(
        self, n_heads: int, num_buckets: int, max_distance: int, bidirectional: bool, max_len: int = 1024
    ) -> None:
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional, self.n_heads, self.max_len = bidirectional, n_heads, max_len
        self.weight = nn.Parameter(torch.zeros(num_buckets, n_heads))
        self.reset_buffers()

    @property
    def params(self) -> tuple[Tensor, ...]:
        """The learned tensors the rule reads (flex's backward returns their gradients)."""
        return (self.weight,)

    @property
    def reach(self) -> int:
        """Beyond this distance every offset of one side falls in that side's last bucket."""
        return self.max_distance

    def reset_buffers(self, device: torch.device | None = None) -> None:
        relative = torch.arange(-self.max_len, self.max_len + 1, device="cpu")  # (2 max_len + 1,)
        self.register_buffer("buckets", placed(self.bucket(relative), device), persistent=False)

    def bucket(self, relative: Tensor) -> Tensor:
        """relative = key_pos - query_pos -> bucket index in [0, num_buckets)."""
        n_buckets, offset = self.num_buckets, torch.zeros_like(relative)
        if self.bidirectional:
            n_buckets //= 2
            offset = (relative > 0).long() * n_buckets
            distance = relative.abs()
        else:
            distance = (-relative).clamp(min=0)
        exact = n_buckets // 2
        log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
        large = (exact + (log_ratio * (n_buckets - exact)).long()).clamp(max=n_buckets - 1)
        return offset + torch.where(distance < exact, distance, large)

    def rule(self, q_pos: Tensor, k_pos: Tensor) -> Rule:
        """Positions (B, T), (B, S) -> the bias of (b, h, q, kv): weight[bucket(k - q), h]."""
        weight, buckets, shift = self.weight, self.buckets, self.max_len
        return lambda b, h, q, kv: weight[buckets[k_pos[b, kv] - q_pos[b, q] + shift], h]

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:  # (B, T), (B, S) -> (B, H, T, S)
        return dense_bias(self.rule(q_pos, k_pos), q_pos.shape[0], self.n_heads, q_pos.shape[1], k_pos.shape[1],
                          q_pos.device)  # fmt: skip
