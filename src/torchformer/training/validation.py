"""An evaluation row's measures for ``train()``: the validation loss per target token and its
perplexity, and a preference objective's rewards and accuracies (preference.py)."""

from __future__ import annotations

import torch
from torch import nn

from . import preference
from .batches import n_targets
from .report import perplexity


def validate(objective: nn.Module, evals, device: torch.device, amp) -> dict:
    """An evaluation row's measures: val_loss and val_ppl; a preference objective's rewards and
    accuracies beside them (its val_ppl is exp of the preference loss, kept for one row shape)."""
    if isinstance(objective, preference.Preference):
        measured = preference.validate(objective, evals, device, amp)
        return {"val_loss": measured["val_loss"], "val_ppl": perplexity(measured["val_loss"]), **measured}
    val_loss = evaluate(objective, evals, device, amp)
    return {"val_loss": val_loss, "val_ppl": perplexity(val_loss)}


@torch.no_grad()
def evaluate(objective: nn.Module, evals, device: torch.device, amp) -> float:
    """Mean validation loss per target token (no label smoothing: a true NLL, so exp() is perplexity)."""
    was = objective.training
    objective.eval()
    total, count = 0.0, 0
    for batch in evals:
        batch = {k: v.to(device) for k, v in batch.items()}
        with amp():
            total += float(objective(batch, smoothing=0.0))
        count += n_targets(batch)
    objective.train(was)
    return total / max(1, count)
