"""The summed next-token loss over vocabulary-sharded logits, never gathering them.

The logits come out of a column-parallel LM head as a DTensor sharded on the vocabulary
(parallel/plan.py, loss_parallel=True): each rank holds (B, T, V/tp); nn/loss.py's token_loss
hands such logits here. torch's ``loss_parallel`` computes cross-entropy on that layout with small
all-reduces per row (the max, the sum of exponentials, the label's logit), but its backward must
also run inside the context, and the training loop calls ``backward()`` far from the loss. So the
gradient with respect to the logits (softmax - onehot, itself sharded) is computed here in the
forward and kept; backward scales it by the incoming gradient. The cost: one more (B, T, V/tp)
tensor per rank until backward.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE = -100  # the label no loss counts (nn/loss.py imports this module, not the reverse)


def is_sharded(x: Tensor) -> bool:
    """Whether x is a DTensor. Read from sys.modules: a DTensor exists only once its module is
    imported, and importing it costs seconds that a process without parallelism should not pay."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def _summed(logits, labels: Tensor):
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE)


class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels: Tensor) -> Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        with torch.enable_grad(), loss_parallel():  # its backward too must run inside (module docstring)
            x = logits.detach().requires_grad_()
            loss = _summed(x, labels)
            (grad,) = torch.autograd.grad(loss, x)  # (B, T, V) sharded like the logits
        ctx.save_for_backward(grad)
        return loss.to_local()  # replicated over the TP ranks: the local value is the whole sum

    @staticmethod
    def backward(ctx, g: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * g.item(), None


def sharded_token_loss(logits, labels: Tensor, smoothing: float = 0.0) -> Tensor:
    """Sum over labelled positions of -log p(label), from logits (..., V) sharded by vocabulary;
    labels (...) whole on every rank. A plain scalar tensor, equal on every TP rank."""
    if smoothing:
        raise ValueError(
            f"smoothing={smoothing!r}: label smoothing is not supported with tensor parallelism's sharded loss "
            "(torch's loss_parallel has none); use train.label_smoothing: 0"
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must be the logits shape without its last dimension, "
                         f"{tuple(logits.shape[:-1])}")  # fmt: skip
    if not torch.is_grad_enabled() or not logits.requires_grad:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return _summed(logits, labels).to_local()
    return _ShardedCrossEntropy.apply(logits, labels)
