"""Objectives as (summed loss, number of target tokens), so gradient accumulation and data
parallelism can divide by the real token count of the whole global batch, not per micro-batch.

Each objective is an nn.Module wrapping the model, so DDP/FSDP/compile wrap one forward that
returns the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.loss import IGNORE, token_loss
from ..nn.moe import RouterOutput, record_routing
from .batches import Batch


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
