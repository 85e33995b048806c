"""Objectives as (summed loss, number of target tokens), so gradient accumulation and data
parallelism can divide by the real token count of the whole global batch, not per micro-batch.

Each objective is an nn.Module wrapping the model, so DDP/FSDP/compile wrap one forward that
returns the loss.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .batches import IGNORE, Batch


def token_loss(logits: Tensor, labels: Tensor, smoothing: float = 0.0) -> Tensor:
    """Sum over labelled positions of cross-entropy against the label-smoothed target
    q = (1 - smoothing) * onehot + smoothing / V (Szegedy et al. 2016; Vaswani 2017, 5.4).
    logits (..., V) in any dtype (upcast to fp32), labels (...) with -100 = ignore."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum", label_smoothing=smoothing
    )


class CausalLM(nn.Module):
    def __init__(self, model: nn.Module, smoothing: float = 0.0) -> None:
        super().__init__()
        self.model, self.smoothing = model, smoothing

    def forward(self, batch: Batch, smoothing: float | None = None) -> Tensor:
        """Summed loss over the batch's target tokens; smoothing overrides the training value."""
        logits = self.model(batch["ids"], document_ids=batch.get("document_ids"))  # packed rows carry document ids
        return token_loss(logits, batch["labels"], _pick(smoothing, self.smoothing))


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
