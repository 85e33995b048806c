"""The next-token loss every room computes on a model's logits: training's objectives, evaluation's
perplexity and preference tuning all sum it the same way (labels ``IGNORE`` are left out).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sharded_loss import is_sharded, sharded_token_loss

IGNORE = -100  # a label no loss counts: padding, prompts, the positions a task leaves unscored

# Rows of logits per chunk: ~4 MiB of fp32 at a time (128 rows at V = 8192), whatever the vocabulary.
CHUNK_ELEMENTS = 1 << 20


def token_loss(logits: Tensor, labels: Tensor, smoothing: float = 0.0) -> Tensor:
    """Sum over labelled positions of cross-entropy against the label-smoothed target
    q = (1 - smoothing) * onehot + smoothing / V (Szegedy et al. 2016; Vaswani 2017, 5.4).
    logits (..., V) in any dtype (computed in fp32), labels (...) with -100 = ignore.

    Equal to ``F.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=...)``,
    computed a chunk of rows at a time (``ChunkedCrossEntropy``): backward keeps no second (N, V)
    tensor beside the logits (no fp32 log-softmax, no fp32 upcast copy of bf16 logits)."""
    if is_sharded(logits):  # split by vocabulary over tensor-parallel ranks: summed without a gather
        return sharded_token_loss(logits, labels, smoothing)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must be the logits shape without its last (vocabulary) "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"smoothing={smoothing!r}: must be a number in [0, 1]")
    return ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), float(smoothing))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross-entropy of (N, V) logits, one chunk of rows at a time.

    The loss of row n is -(1 - eps) * log p_{n,y} - eps * mean_v log p_{n,v}; its gradient is
    softmax(x_n) - q_n. Forward keeps only the logits (already alive) and computes each chunk's
    log-softmax in a chunk-sized temporary; backward recomputes softmax (one fused kernel) into
    the gradient buffer itself. Plain F.cross_entropy keeps an fp32 log-softmax (N, V) for
    backward and makes two more (N, V) tensors in it (the nll gradient and the log-softmax
    gradient), plus an fp32 copy of reduced-precision logits: 3-4 logits-sized tensors at the
    loss, against 2 here."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, eps: float) -> Tensor:
        valid = labels != IGNORE
        target = torch.where(valid, labels, 0).unsqueeze(1)  # (N, 1): any class for ignored rows
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows in _chunks(logits):
            logp = torch.log_softmax(logits[rows], dim=-1, dtype=torch.float32)  # (n, V), the chunk only
            picked = logp.gather(1, target[rows]).squeeze(1)  # (n,): log p of the label
            smoothed = (1.0 - eps) * picked + eps * logp.mean(-1) if eps else picked  # sum_v q_v log p_v
            total -= torch.where(valid[rows], smoothed, 0.0).sum()
        ctx.save_for_backward(logits, target, valid)
        ctx.eps = eps
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        logits, target, valid = ctx.saved_tensors
        eps, vocab = ctx.eps, logits.shape[-1]
        scale = torch.where(valid, grad.float(), 0.0)[:, None]  # (N, 1): ignored rows get no gradient
        fp32 = logits.dtype == torch.float32
        # fp32: softmax of all rows is the gradient buffer itself; else fp32 a chunk at a time.
        out = None if fp32 else torch.empty_like(logits)
        for rows in [slice(None)] if fp32 else _chunks(logits):
            g = torch.softmax(logits[rows], dim=-1, dtype=torch.float32).mul_(scale[rows])  # (n, V)
            if eps:
                g.sub_(scale[rows] * (eps / vocab))
            g.scatter_add_(1, target[rows], scale[rows] * (eps - 1.0))  # (softmax - q) * grad
            if fp32:
                out = g
            else:
                out[rows] = g
        return out, None, None


def _chunks(logits: Tensor) -> list[slice]:
    n, step = logits.shape[0], max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]
