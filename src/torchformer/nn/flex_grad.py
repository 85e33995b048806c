"""The backward of the flex backend: FlashAttention-2's backward (Dao 2023, Algorithm 2) over
tiles, in plain torch. torch 2.13 has no FlexAttention backward on CPU (and its compiled CPU
kernel cannot return the log-sum-exp), while recomputing the dense (B, H, T, S) scores would
give up the O(T) memory the forward has.

For each tile of QUERY_TILE queries, scores against the span of key blocks the block mask says
are visible (from the first to the last; for causal, window and document patterns that is
exactly the visible part) are rebuilt from q, k and the same rules the forward used (soft-cap,
bias, mask); the tile holds every visible key of its rows, so P is their softmax, and dQ, dK, dV
and the gradient of a learned bias table accumulate. Memory: a few (B, H, QUERY_TILE, S) tiles.
Legend: B, H, K, T, S, E as in flex.py; G = H / K query heads per kv head; t, s tile sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .patterns import Pattern

QUERY_TILE = 64  # queries per tile: a (B, H, 64, S) fp32 tile is 16 MB at H 8, S 8192


@dataclass
class Tile:
    s: Tensor  # (B, H, t, s) final scores (soft-capped, biased), masked entries not yet removed
    capped: Tensor | None  # tanh(raw / cap) when soft-capping, for its derivative
    bias: Tensor | None  # the bias tile, attached to the learned params' graph
    mask: Tensor | None  # (B, 1, t, s) bool


def tile_scores(pattern: Pattern, q_t: Tensor, k: Tensor, q0: int, k0: int, k1: int, scale: float, softcap) -> Tile:
    """Scores of one query tile (B, K, G, t, E) against keys [k0, k1), rebuilt as the kernel does."""
    B, K, G, t, E = q_t.shape
    dev = q_t.device
    b, h = torch.arange(B, device=dev).view(-1, 1, 1, 1), torch.arange(K * G, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(q0, q0 + t, device=dev).view(1, 1, -1, 1)
    kv = torch.arange(k0, k1, device=dev).view(1, 1, 1, -1)
    s = (q_t * scale @ k[:, :, None, k0:k1].transpose(-1, -2)).view(B, K * G, t, k1 - k0)  # scale on the small side
    capped = None if softcap is None else torch.tanh(s / softcap)
    if capped is not None:
        s = capped * softcap  # Gemma 2's soft-cap, as in the forward
    with torch.enable_grad():
        bias = None if pattern.bias is None else pattern.bias(b, h, qi, kv).expand_as(s)
    if bias is not None:
        s.add_(bias.detach())
    mask = None if pattern.mask is None else pattern.mask(b, h[:, :1], qi, kv)
    return Tile(s, capped, bias, mask)


def probabilities(tile: Tile) -> Tensor:
    """softmax over the visible keys of the tile (the full row: the tile spans every visible
    key); rows with no visible key give zeros. (B, H, t, s), computed in place where possible."""
    s = tile.s if tile.mask is None else tile.s.masked_fill_(~tile.mask, float("-inf"))
    peak = s.amax(-1, keepdim=True).clamp(min=torch.finfo(s.dtype).min)  # -inf rows -> finite
    e = s.sub_(peak).exp_()  # in the tile's own memory: the scores are not needed again
    return e.div_(e.sum(-1, keepdim=True).clamp(min=torch.finfo(s.dtype).tiny))


def key_range(blocks: list[int], block: int, S: int) -> tuple[int, int]:
    """The keys from the first to the last visible block: [start, end)."""
    return blocks[0] * block, min(S, (blocks[-1] + 1) * block)


def tiled_backward(q, k, v, out, dout, pattern: Pattern, spans, block: int, scale: float, softcap):
    """Gradients of flex attention: (dq, dk, dv, [d param for each learned bias param])."""
    B, H, T, E = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    params = [p for p in pattern.params if p.requires_grad]
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    delta = (dof * out.float()).sum(-1)  # (B, H, T): rowsum(dO * O)
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    dparams = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for q0 in range(0, T, QUERY_TILE):
        blocks = spans[q0 // block]
        if not blocks:
            continue  # no row of these queries sees any key: all gradients are zero
        q1 = min(T, q0 + QUERY_TILE)
        k0, k1 = key_range(blocks, block, S)
        q_t = qf[:, :, q0:q1].reshape(B, K, G, q1 - q0, E)  # (B, K, G, t, E)
        do_t = dof[:, :, q0:q1].reshape(B, K, G, q1 - q0, E)
        tile = tile_scores(pattern, q_t, kf, q0, k0, k1, scale, softcap)
        p = probabilities(tile)  # (B, H, t, s)
        dv[:, :, k0:k1] += (p.view(B, K, G, q1 - q0, k1 - k0).transpose(-1, -2) @ do_t).sum(2)
        dp = (do_t @ vf[:, :, None, k0:k1].transpose(-1, -2)).view(B, H, q1 - q0, k1 - k0)
        ds = dp.sub_(delta[:, :, q0:q1, None]).mul_(p)  # d loss / d (score + bias), in dp's memory
        del p
        if params and tile.bias is not None:
            for acc, g in zip(dparams, torch.autograd.grad(tile.bias, params, ds, allow_unused=True)):
                acc += 0.0 if g is None else g
        if tile.capped is not None:
            ds.mul_(1.0 - tile.capped * tile.capped)
        dsg = ds.view(B, K, G, q1 - q0, k1 - k0)  # the score scale goes on the small products
        dq[:, :, q0:q1] = (dsg @ kf[:, :, None, k0:k1]).view(B, H, q1 - q0, E) * scale
        dk[:, :, k0:k1] += (dsg.transpose(-1, -2) @ q_t).sum(2) * scale
    grads = [dparam.to(p.dtype) for dparam, p in zip(dparams, params)]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grads
