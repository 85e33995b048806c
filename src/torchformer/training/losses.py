"""Objectives as (summed loss, number of target tokens), so gradient accumulation and data
parallelism can divide by the real token count of the whole global batch, not per micro-batch.

Each objective is an nn.Module wrapping the model, so DDP/FSDP/compile wrap one forward that
returns the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.moe import RouterOutput, record_routing
from .batches import IGNORE, Batch

# Rows of logits per chunk: ~4 MiB of fp32 at a time (128 rows at V = 8192), whatever the vocabulary.
CHUNK_ELEMENTS = 1 << 20


def token_loss(logits: Tensor, labels: Tensor, smoothing: float = 0.0) -> Tensor:
    """Sum over labelled positions of cross-entropy against the label-smoothed target
    q = (1 - smoothing) * onehot + smoothing / V (Szegedy et al. 2016; Vaswani 2017, 5.4).
    logits (..., V) in any dtype (computed in fp32), labels (...) with -100 = ignore.

    Equal to ``F.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=...)``,
    computed a chunk of rows at a time (``ChunkedCrossEntropy``): backward keeps no second (N, V)
    tensor beside the logits (no fp32 log-softmax, no fp32 upcast copy of bf16 logits)."""
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


def load_balancing_loss(routed: list[RouterOutput]) -> Tensor:
    """Switch Transformer (Fedus 2021, eq. 4) in Mixtral's top-k form, per MoE layer
    E * sum_e f_e * P_e with f_e the fraction of tokens that chose expert e among their top k and
    P_e the mean softmax router probability of e (1 * k when balanced); the mean over layers."""
    per_layer = []
    for r in routed:
        chosen = F.one_hot(r.experts, r.logits.shape[-1]).sum(1).float()  # (N, E): 1 where chosen
        probs = r.logits.float().softmax(-1)  # (N, E)
        per_layer.append(r.logits.shape[-1] * (chosen.mean(0) * probs.mean(0)).sum())
    return torch.stack(per_layer).mean()


def router_z_loss(routed: list[RouterOutput]) -> Tensor:
    """ST-MoE (Zoph 2022, eq. 5): mean over tokens of logsumexp(router logits)^2, mean over layers;
    keeps router logits small so the fp32 softmax stays well conditioned."""
    return torch.stack([r.logits.float().logsumexp(-1).square().mean() for r in routed]).mean()


class CausalLM(nn.Module):
    """balance / z: weights of the MoE router losses (recipe train.moe_balance, train.moe_z_loss),
    added per target token while training; ``router_losses`` keeps the last values for the log."""

    def __init__(self, model: nn.Module, smoothing: float = 0.0, balance: float = 0.0, z: float = 0.0) -> None:
        super().__init__()
        self.model, self.smoothing, self.balance, self.z = model, smoothing, balance, z
        self.router_losses: dict[str, Tensor] = {}

    def forward(self, batch: Batch, smoothing: float | None = None) -> Tensor:
        """Summed loss over the batch's target tokens; smoothing overrides the training value."""
        with record_routing(self.model) as routed:
            logits = self.model(batch["ids"], document_ids=batch.get("document_ids"))  # packed rows carry ids
        loss = token_loss(logits, batch["labels"], _pick(smoothing, self.smoothing))
        if not (routed and self.training):
            return loss
        balance, z = load_balancing_loss(routed), router_z_loss(routed)
        self.router_losses = {"balance_loss": balance.detach(), "z_loss": z.detach()}
        n = (batch["labels"] != IGNORE).sum()  # the loss is a sum over targets; so are its penalties
        return loss + n * (self.balance * balance + self.z * z)


class MaskedLM(CausalLM):
    def forward(self, batch: Batch, smoothing: float | None = None) -> Tensor:
        hidden = self.model(batch["ids"])  # (B, T, D)
        return token_loss(self.model.mlm_logits(hidden), batch["labels"], _pick(smoothing, self.smoothing))


class Seq2Seq(CausalLM):
    """Teacher forcing: the decoder reads <s> + target and predicts target + </s>."""

    def forward(self, batch: Batch, smoothing: float | None = None) -> Tensor:
        logits = self.model(batch["src"], batch["tgt"], src_mask=batch["src_mask"])
        return token_loss(logits, batch["labels"], _pick(smoothing, self.smoothing))


def _pick(override: float | None, default: float) -> float:
    return default if override is None else override


OBJECTIVES = {"lm": CausalLM, "mlm": MaskedLM, "seq2seq": Seq2Seq}
ARCH_OF_TASK = {"lm": "decoder", "mlm": "encoder", "seq2seq": "encoder_decoder"}
