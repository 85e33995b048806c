"""Attention whose mask and bias depend only on the offset kv - q: torch's fused CPU flash kernel
over query chunks, each chunk's bias a zero-copy strided view of one vector per head.

When every row's queries and keys sit at the same positions (self-attention without a cache,
padding or documents: ``Pattern.aligned``), each rule of the pattern -- causal order, a sliding
window, ALiBi, T5's buckets -- is a function of (head, kv - q) alone, so a head's (T, S) bias is a
Toeplitz matrix. ``offset_vector`` evaluates the rules once per forward at the L = T + S - 1
offsets (-inf where masked). A tile of a Toeplitz matrix whose query rows are taken in reverse
order is a view with strides (1, 1) into that vector, and torch's CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward) reads an ``attn_mask`` of any
strides. Each chunk of CHUNK queries therefore runs the fused kernel against its visible keys with
no (T, S) tensor materialised and nothing compiled, and the log-sum-exp the kernel returns gives
the fused backward too (which flex cannot offer on CPU: flex_grad.py).

A learned bias (T5's table) needs d loss / d u[h, d] = sum_i dS[h, i, i + d]. T5's buckets are
constant beyond ``reach`` (its max_distance) on each side, so only the offsets |d| < reach need
their own sums, recomputed on band tiles (O(T * reach)); each far side needs only its total.
Every row of dS sums to zero (sum_j P_ij (dP_ij - delta_i) = delta_i - delta_i), so the far-left
total is minus all the rest; the far-right one (bidirectional models only) comes from a flash
forward restricted to that region: sum_(j in R) dS_ij = m_i (dO_i . o_R,i - delta_i) with
m_i = exp(lse_R,i - lse_i).

Legend: B batch, H query heads, K kv heads, G = H / K, T queries, S keys, E head dim, L offsets,
C chunk, W band width.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .backends import dense_fallback
from .patterns import Pattern

CHUNK = 512  # queries per kernel call: fastest of 128/256/512 at T = 8192 here (forward + backward)
BAND_CHUNK = 128  # queries per band tile of the learned bias' gradient: a few (B, H, 128, 128 + 2 reach) fp32
_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass
class Offsets:
    """A pattern as one vector per head over the offsets d = kv - q, at index d + T - 1."""

    u: Tensor  # (H, L) bias, -inf where masked; carries the learned bias' graph
    lo: int  # smallest visible offset
    hi: int  # largest visible offset


def applies(pattern: Pattern | None, softcap: float | None) -> bool:
    """Whether this path can run the pattern: aligned self-attention on CPU, no soft-cap (the fused
    kernel has no hook for it), and any learned bias of known reach."""
    if pattern is None or not pattern.aligned or pattern.T != pattern.S or softcap is not None:
        return False
    on_cpu = pattern.device == torch.device("cpu")  # the fused kernel used here is the CPU one
    return on_cpu and (not pattern.params or pattern.reach is not None)


def offset_vector(pattern: Pattern) -> Offsets:
    """The pattern's rules at one (query, key) pair per offset: (0, d) for d >= 0, (-d, 0) below."""
    T, S, H, dev = pattern.T, pattern.S, pattern.H, pattern.device
    d = torch.arange(-(T - 1), S, device=dev)  # (L,)
    q, kv = (-d).clamp(min=0).view(1, -1), d.clamp(min=0).view(1, -1)
    b, h = torch.zeros(1, 1, dtype=torch.long, device=dev), torch.arange(H, device=dev).view(H, 1)
    u = torch.zeros(H, d.numel(), device=dev) if pattern.bias is None else pattern.bias(b, h, q, kv).float()
    u = u.expand(H, d.numel())
    visible = torch.ones_like(d, dtype=torch.bool) if pattern.mask is None else pattern.mask(b, h[:1], q, kv)[0]
    u = u.masked_fill(~visible, float("-inf")).contiguous()
    seen = visible.nonzero().flatten()
    lo, hi = (0, -1) if seen.numel() == 0 else (int(seen[0]) - (T - 1), int(seen[-1]) - (T - 1))
    return Offsets(u, lo, hi)


def chunks(T: int, S: int, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1): each query chunk and the span of keys some row of it can see."""
    for q0 in range(0, T, CHUNK):
        q1 = min(T, q0 + CHUNK)
        k0, k1 = max(0, q0 + lo), min(S, q1 + hi)
        if k1 > k0:
            yield q0, q1, k0, k1


def tile(u: Tensor, g: int, G: int, q0: int, q1: int, k0: int, k1: int, T: int) -> Tensor:
    """(1, K, C, k1 - k0) view of u for query heads g, g + G, ... and the chunk's rows reversed:
    row r is query q1 - 1 - r, so entry (r, j) is u[k0 + j - (q1 - 1 - r) + T - 1]."""
    K, L = u.shape[0] // G, u.shape[1]
    return u.as_strided((1, K, q1 - q0, k1 - k0), (0, G * L, 1, 1), u.storage_offset() + g * L + k0 - q1 + T)


def flash_forward(q: Tensor, k: Tensor, v: Tensor, u: Tensor, lo: int, hi: int, scale: float):
    """Chunked fused forward: (out (B, H, T, E), lse (B, H, T) fp32); rows that see nothing give 0.
    Each chunk's queries go in reversed (a copy of C rows), as ``tile`` needs."""
    B, H, T, _ = q.shape
    G = H // k.shape[1]
    out, lse = q.new_zeros(B, H, T, v.shape[-1]), torch.zeros(B, H, T, device=q.device)
    for g in range(G):
        for q0, q1, k0, k1 in chunks(T, k.shape[2], lo, hi):
            rows = (slice(None), slice(g, None, G), slice(q0, q1))
            o, m = _FORWARD(q[rows].flip(2), k[:, :, k0:k1], v[:, :, k0:k1], 0.0, False,
                            attn_mask=tile(u, g, G, q0, q1, k0, k1, T), scale=scale)  # fmt: skip
            out[rows], lse[rows] = o.flip(2), m.flip(2)
    return out, lse


class _OffsetAttention(torch.autograd.Function):
    """Chunked fused forward and backward; the learned bias' gradient by ``bias_grad``."""

    @staticmethod
    def forward(ctx, q, k, v, u, lo, hi, reach, scale):
        out, lse = flash_forward(q, k, v, u.detach().to(q.dtype), lo, hi, scale)
        ctx.save_for_backward(q, k, v, u, out, lse)
        ctx.args = (lo, hi, reach, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, u, out, lse = ctx.saved_tensors
        lo, hi, reach, scale = ctx.args
        B, H, T, _ = q.shape
        G = H // k.shape[1]
        um, dout = u.detach().to(q.dtype), dout.contiguous()  # an expanded dout would flip slowly
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for g in range(G):
            for q0, q1, k0, k1 in chunks(T, k.shape[2], lo, hi):
                rows = (slice(None), slice(g, None, G), slice(q0, q1))
                a, b, c = _BACKWARD(dout[rows].flip(2), q[rows].flip(2), k[:, :, k0:k1], v[:, :, k0:k1],
                                    out[rows].flip(2), lse[rows].flip(2), 0.0, False,
                                    attn_mask=tile(um, g, G, q0, q1, k0, k1, T), scale=scale)  # fmt: skip
                dq[rows] = a.flip(2)
                dk[:, :, k0:k1] += b
                dv[:, :, k0:k1] += c
        du = bias_grad(q, k, v, u.detach(), out, lse, dout, lo, hi, reach, scale) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, du, None, None, None, None


def bias_grad(q, k, v, u, out, lse, dout, lo, hi, reach, scale) -> Tensor:
    """d loss / d u (H, L): exact within |d| < reach, each far side's total at d = -+reach (module
    docstring)."""
    B, H, T, E = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    qf, kf, vf, df = q.float(), k.float(), v.float(), dout.float()
    delta = (df * out.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
    du = torch.zeros_like(u)
    for q0 in range(0, T, BAND_CHUNK):
        q1 = min(T, q0 + BAND_CHUNK)
        k0, k1 = max(0, q0 - reach + 1, q0 + lo), min(S, q1 + reach - 1, q1 + hi)
        if k1 <= k0:
            continue
        C, W = q1 - q0, k1 - k0
        idx = torch.arange(k0, k1, device=q.device)[None, :] - torch.arange(q0, q1, device=q.device)[:, None] + T - 1
        s = (qf[:, :, q0:q1].view(B, K, G, C, E) @ kf[:, :, None, k0:k1].transpose(-1, -2)).view(B, H, C, W)
        p = (s * scale + u[:, idx] - lse[:, :, q0:q1, None]).exp()  # (B, H, C, W)
        dp = (df[:, :, q0:q1].view(B, K, G, C, E) @ vf[:, :, None, k0:k1].transpose(-1, -2)).view(B, H, C, W)
        ds = (p * (dp - delta[:, :, q0:q1, None])).sum(0)  # (H, C, W)
        ds = ds.masked_fill((idx - (T - 1)).abs() >= reach, 0.0)  # far offsets: only their totals count
        du.index_add_(1, idx.flatten(), ds.flatten(1))
    right, left = T - 1 + reach, T - 1 - reach  # indices of offsets +reach and -reach
    if right < u.shape[1] and not torch.isneginf(u[:, right:]).all():
        du[:, right] += far_right_total(qf, kf, vf, u, lse, df, delta, lo, hi, reach, scale)
    if left >= 0:
        du[:, left] -= du.sum(1)  # rows of dS sum to zero: the far-left total is minus the rest
    return du


def far_right_total(q, k, v, u, lse, dout, delta, lo, hi, reach, scale) -> Tensor:
    """sum over rows i and keys j >= i + reach of dS, per head (H,), from a restricted forward."""
    T = q.shape[2]
    right = T - 1 + reach
    ur = u.clone()
    ur[:, :right] = float("-inf")
    o_r, lse_r = flash_forward(q, k, v, ur, max(lo, reach), hi, scale)
    # Rows whose region holds no visible key (the kernel gives lse 0 there): count its visible
    # offsets [reach, S - 1 - i] with a prefix sum over the offsets.
    count = torch.isfinite(ur[0]).long().cumsum(0)  # (L,)
    last = torch.arange(T - 1, -1, -1, device=q.device) + (k.shape[2] - T) + T - 1  # index of S - 1 - i
    seen = (count[last] - count[right - 1]) > 0  # (T,)
    m = (lse_r - lse).exp() * seen  # (B, H, T): softmax mass of the region
    return (m * ((dout * o_r).sum(-1) - delta)).sum((0, 2))


def offset_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    pattern: Pattern,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    **_dense,
) -> Tensor:
    """The backends' signature for a pattern ``applies`` accepted (``pattern.offsets`` built)."""
    if dropout_p > 0.0 or torch.compiler.is_compiling():
        # No dropout inside the fused CPU kernel; inside an outer torch.compile the chunk loop
        # would unroll.
        return dense_fallback(q, k, v, pattern, scale=scale, dropout_p=dropout_p, softcap=softcap)
    off = pattern.offsets
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or off.u.requires_grad):
        return _OffsetAttention.apply(q, k, v, off.u, off.lo, off.hi, pattern.reach, scale)
    return flash_forward(q, k, v, off.u.to(q.dtype), off.lo, off.hi, scale)[0]
