"""Attention backends with one signature:
(q, k, v, *, mask, bias, is_causal, scale, dropout_p, softcap, pattern).

q (B, H, T, E); k, v (B, K, S, E) with H a multiple of K (GQA); mask (B, 1|H, T, S) bool,
True = may attend; bias (B|1, H, T, S) added to the scaled scores. Query rows whose mask
allows nothing return zeros, never NaN.

``math_attention`` is the reference: matmul, fp32 softmax, matmul, and the only backend that can
return the weights. ``sdpa_attention`` calls torch's fused kernel and shares K/V across a group
with ``enable_gqa`` instead of copying them. ``softcap`` applies cap * tanh(score / cap) to the
scaled scores before the bias (Gemma 2); SDPA has no hook for it, so a soft-capped call to
``sdpa_attention`` computes explicit scores through the reference. ``pattern`` (nn/patterns.py)
carries the rules the stack built; a backend given no dense mask/bias but a pattern (the
recorder's math on a flex model, a backend swapped in by verify) evaluates it densely once.

A cached step attends only over the cache slots some query can see. The static cache has S_max +
1 slots whatever the step (nn/kv_cache.py), so a compiled decode step keeps one shape and never
recompiles; but a query at position p sees slots <= p only, and a dense-mask SDPA still streams
the rest: at batch 8 over the decode benchmark's 320-slot cache, early in a generation, that was
~3.4 ms of a 12 ms compiled step, and ~1 ms of a 5.5 ms one at batch 1 (profiles). So
``sdpa_attention`` on the CPU without autograd hands a cached step (``Pattern.live``: max
position + 1, a 0-d tensor computed in the graph) to the custom op ``torchformer::prefix_sdpa``,
which reads that count (a host read: CPU only, where it costs nothing) and runs the same SDPA
over that prefix of keys, mask and bias. torch.compile sees an opaque op: one graph for every
step, each step the work of its real length. The slots cut off are masked for every query (exact
zero weights), so only the kernel's blocking of the sums changes (fp32 reassociation). On the
CPU, a step with one query per row (decoding) runs the decode kernel where it is built
(fast/attention.py registers it as the op's CPU kernel; nn/ knows nothing of it): one pass over
each row's keys and values per KV head, ~1.5x faster than SDPA's flash kernel there (72 against
108 us per layer at 8 rows x 8 heads x 75 keys, 1 thread).
``math_attention`` stays the plain reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .patterns import Pattern


def math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    scale: float,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    pattern: Pattern | None = None,
    need_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(softcap(q k^T * scale) + bias, masked) v with an fp32 softmax. Returns (B, H, T, E)
    and, with need_weights, the post-softmax weights (B, H, T, S)."""
    mask, bias = dense_inputs(mask, bias, is_causal, pattern)
    B, H, T, E = q.shape
    K, S = k.shape[1], k.shape[2]
    # The G = H / K query heads sharing a K/V head are stacked as G * T rows against it, one plain
    # matmul per K/V head: (B, K, G*T, E) @ (B, K, E, S). (A broadcast over a group axis would make
    # matmul expand and copy K and V G times.)
    qg = q.float().reshape(B, K, H // K * T, E)
    scores = (qg @ k.float().transpose(-1, -2)).view(B, H, T, S) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)  # Gemma 2: keeps logits in (-cap, cap)
    if bias is not None:
        scores = scores + bias
    if is_causal:
        mask = causal_triangle(T, S, q.device, mask)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=-1)
    if mask is not None:
        # Exact zeros for masked keys, and all-zero rows where nothing is visible.
        weights = weights * mask
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = (weights.reshape(B, K, H // K * T, S) @ v.float()).view(B, H, T, v.shape[-1]).to(q.dtype)
    return (out, weights) if need_weights else out


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    scale: float,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    pattern: Pattern | None = None,
) -> Tensor:
    """torch.nn.functional.scaled_dot_product_attention with the reference's semantics."""
    if softcap is not None:  # SDPA cannot soft-cap inside its kernel: explicit scores
        return math_attention(q, k, v, mask=mask, bias=bias, is_causal=is_causal, scale=scale,
                              dropout_p=dropout_p, softcap=softcap, pattern=pattern)  # fmt: skip
    mask, bias = dense_inputs(mask, bias, is_causal, pattern)
    if pattern is not None and pattern.live is not None and prefix_applies(q, is_causal, dropout_p):
        # A cached step's mask and bias are its pattern's dense form (the stack built both).
        return torch.ops.torchformer.prefix_sdpa(q, k, v, pattern.additive(q.dtype), pattern.live, scale)
    T, S = q.shape[-2], k.shape[-2]
    if is_causal and (T != S or bias is not None or mask is not None):
        # SDPA's own is_causal aligns the triangle top-left when T != S and refuses an extra mask;
        # the reference's triangle is bottom-right (the last query sees every key).
        mask, is_causal = causal_triangle(T, S, q.device, mask), False
    attn_mask = mask
    if bias is not None:
        attn_mask = bias.to(q.dtype)
        if mask is not None:
            attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    if mask is not None:
        # A row with no visible key: zeros, as the reference gives. Some SDPA kernels return NaN
        # there, and NaN * 0 is NaN, so select instead of multiplying.
        out = out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    return out


def prefix_applies(q: Tensor, is_causal: bool, dropout_p: float) -> bool:
    """Whether a cached step's SDPA cuts the cache to its live prefix (module docstring)."""
    return q.is_cpu and not is_causal and dropout_p == 0.0 and not torch.is_grad_enabled()


# A plain operator definition, not torch.library.custom_op: the op runs once per layer per decode
# step, and custom_op's autograd and dispatch wrappers cost ~21 us a call against ~4 us for a plain
# definition (measured, one thread, an identity op). No autograd formula: the op only runs where
# grad mode is off (``prefix_applies``).
LIBRARY = torch.library.Library("torchformer", "FRAGMENT")
LIBRARY.define("prefix_sdpa(Tensor q, Tensor k, Tensor v, Tensor? term, Tensor live, float scale) -> Tensor")


def prefix_sdpa(q: Tensor, k: Tensor, v: Tensor, term: Tensor | None, live: Tensor, scale: float) -> Tensor:
    """SDPA of q (B, H, T, E) over the first ``live`` of the S slots of k, v (B, K, S, E), with the
    additive term (B, 1|H, T, S) (``Pattern.additive``) cut to the same slots.

    Without sdpa_attention's guard for query rows that see no key: in a cached step every query
    sees slot 0..its position (causal; a window always holds the query's own slot), so none is
    empty. Called per layer per step: what it skips is most of its cost at batch 1. On the CPU,
    fast/attention.py registers the kernel that runs instead (the decode kernel where it applies)."""
    return sdpa_prefix(q, k, v, term, int(live), scale)


LIBRARY.impl("prefix_sdpa", prefix_sdpa, "CompositeExplicitAutograd")


def sdpa_prefix(q: Tensor, k: Tensor, v: Tensor, term: Tensor | None, n: int, scale: float) -> Tensor:
    """SDPA over the first n slots (``prefix_sdpa``'s arithmetic)."""
    term = None if term is None else term[..., :n]  # (B, 1|H, T, n)
    return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], attn_mask=term, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip


@torch.library.register_fake("torchformer::prefix_sdpa")
def _(q, k, v, term, live, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def causal_triangle(T: int, S: int, device: torch.device, mask: Tensor | None) -> Tensor:
    """The lower triangle aligned bottom-right (query i sees keys <= i + S - T), AND ``mask``."""
    tri = torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)[None, None]  # (1, 1, T, S)
    return tri if mask is None else tri & mask


def dense_inputs(mask: Tensor | None, bias: Tensor | None, is_causal: bool, pattern: Pattern | None):
    """The dense (mask, bias) to use: the given ones, or the pattern's dense form when the caller
    prepared none (is_causal alone needs neither)."""
    if mask is None and bias is None and not is_causal and pattern is not None:
        return pattern.dense()
    return mask, bias


def dense_fallback(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, *, scale: float, dropout_p: float,
                   softcap: float | None) -> Tensor:  # fmt: skip
    """The pattern's dense form through the reference with dropout (no fused path has in-kernel
    dropout) or SDPA without (inside an outer torch.compile, where flex / offsets cannot run on
    CPU): exact either way, for the in-kernel paths to fall back on."""
    mask, bias = pattern.dense()
    backend = math_attention if dropout_p > 0.0 else sdpa_attention
    return backend(q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p, softcap=softcap)
