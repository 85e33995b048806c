"""The backward of the flex backend: FlashAttention-2's backward (Dao 2023, Algorithm 2) over
tiles, in plain torch. torch 2.13 has no FlexAttention backward on CPU (and its compiled CPU
kernel cannot return the log-sum-exp), while recomputing the dense (B, H, T, S) scores would
give up the O(T) memory the forward has.

For each 128-query tile, the runs of key blocks that the block mask says are visible are visited
twice: once to recompute the rows' log-sum-exp, once to form P = exp(S - lse) and accumulate dQ,
dK, dV and the gradient of a learned bias table. Scores are rebuilt from q, k and the same rules
the forward used (soft-cap, bias, mask). Memory: a few (B, H, 128, KEY_CHUNK) tiles.
Legend: B, H, K, T, S, E as in flex.py; G = H / K query heads per kv head; t, s tile sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .patterns import Pattern

KEY_CHUNK = 1024  # keys per tile: large enough for efficient matmuls, small enough to stay O(T)


def key_runs(blocks: list[int], block: int, S: int) -> list[tuple[int, int]]:
    """Visible key-block indices -> [start, end) key ranges of at most KEY_CHUNK keys."""
    runs: list[tuple[int, int]] = []
    for j in blocks:
        lo, hi = j * block, min(S, (j + 1) * block)
        if runs and runs[-1][1] == lo and hi - runs[-1][0] <= KEY_CHUNK:
            runs[-1] = (runs[-1][0], hi)
        else:
            runs.append((lo, hi))
    return runs


@dataclass
class Tile:
    s: Tensor  # (B, H, t, s) final scores (soft-capped, biased), masked entries not yet removed
    capped: Tensor | None  # tanh(raw / cap) when soft-capping, for its derivative
    bias: Tensor | None  # the bias tile, attached to the learned params' graph
    mask: Tensor | None  # (B, 1, t, s) bool


class TileScores:
    """Scores of one query tile against key ranges, rebuilt exactly as the forward's kernel does."""

    def __init__(self, pattern: Pattern, q_t: Tensor, q0: int, q1: int, k: Tensor, scale: float, softcap) -> None:
        dev = q_t.device
        self.pattern, self.q_t, self.k, self.scale, self.softcap = pattern, q_t, k, scale, softcap
        self.b = torch.arange(pattern.B, device=dev).view(-1, 1, 1, 1)
        self.h = torch.arange(pattern.H, device=dev).view(1, -1, 1, 1)
        self.qi = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)

    def __call__(self, k0: int, k1: int) -> Tile:
        B, K, G, t, E = self.q_t.shape
        kv = torch.arange(k0, k1, device=self.q_t.device).view(1, 1, 1, -1)
        s = (self.q_t @ self.k[:, :, None, k0:k1].transpose(-1, -2)).view(B, K * G, t, k1 - k0) * self.scale
        capped = None if self.softcap is None else torch.tanh(s / self.softcap)
        if capped is not None:
            s = self.softcap * capped  # Gemma 2's soft-cap, as in the forward
        p = self.pattern
        with torch.enable_grad():
            bias = None if p.bias is None else p.bias(self.b, self.h, self.qi, kv).expand_as(s)
        if bias is not None:
            s = s + bias.detach()
        mask = None if p.mask is None else p.mask(self.b, self.h[:, :1], self.qi, kv)
        return Tile(s, capped, bias, mask)


def tile_lse(scores: TileScores, runs: list[tuple[int, int]]) -> Tensor:
    """Log-sum-exp over the visible keys of each row of the tile: (B, H, t); 0 where none is."""
    lse = None
    for k0, k1 in runs:
        tile = scores(k0, k1)
        s = tile.s if tile.mask is None else tile.s.masked_fill(~tile.mask, float("-inf"))
        part = torch.logsumexp(s, dim=-1)
        lse = part if lse is None else torch.logaddexp(lse, part)
    return lse.masked_fill(lse.isinf(), 0.0)  # rows with no visible key: P is masked to 0 anyway


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
    for i, blocks in enumerate(spans):
        q0, q1 = i * block, min(T, (i + 1) * block)
        q_t = qf[:, :, q0:q1].reshape(B, K, G, q1 - q0, E)  # (B, K, G, t, E)
        do_t = dof[:, :, q0:q1].reshape(B, K, G, q1 - q0, E)
        scores, runs = TileScores(pattern, q_t, q0, q1, kf, scale, softcap), key_runs(blocks, block, S)
        lse, dq_t = tile_lse(scores, runs), torch.zeros_like(q_t)
        for k0, k1 in runs:
            tile = scores(k0, k1)
            p = torch.exp(tile.s - lse[..., None])  # (B, H, t, s)
            if tile.mask is not None:
                p = p.masked_fill(~tile.mask, 0.0)
            pg = p.view(B, K, G, q1 - q0, k1 - k0)
            dv[:, :, k0:k1] += (pg.transpose(-1, -2) @ do_t).sum(2)
            dp = (do_t @ vf[:, :, None, k0:k1].transpose(-1, -2)).view(B, H, q1 - q0, k1 - k0)
            ds = p * (dp - delta[:, :, q0:q1, None])  # d loss / d (score + bias)
            if params and tile.bias is not None:
                for acc, g in zip(dparams, torch.autograd.grad(tile.bias, params, ds, allow_unused=True)):
                    acc += 0.0 if g is None else g
            if tile.capped is not None:
                ds = ds * (1.0 - tile.capped * tile.capped)
            dsg = (ds * scale).view(B, K, G, q1 - q0, k1 - k0)
            dq_t += dsg @ kf[:, :, None, k0:k1]
            dk[:, :, k0:k1] += (dsg.transpose(-1, -2) @ q_t).sum(2)
        dq[:, :, q0:q1] = dq_t.view(B, H, q1 - q0, E)
    grads = [dparam.to(p.dtype) for dparam, p in zip(dparams, params)]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grads
