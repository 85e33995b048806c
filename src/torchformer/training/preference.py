"""Preference tuning: ``train.objective: dpo | simpo | orpo`` on pairs of answers to one prompt.

Each objective is a small config (its own fields only, from the recipe's ``preference`` section)
with a ``loss`` that reads like its paper. The inputs are sequence log-probabilities of the
chosen answer y_w and the rejected one y_l given the prompt x, summed over the answer's tokens:

  DPO (Rafailov et al. 2023, eq. 7), with h = log pi(y_w|x)/pi_ref(y_w|x) - log pi(y_l|x)/pi_ref(y_l|x):
    sigmoid  -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)   (eps > 0: conservative DPO, Mitchell 2023)
    robust   (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps)   (Chowdhury et al. 2024)
    hinge    max(0, 1 - beta h)                                     (SLiC, Zhao et al. 2023)
    ipo      (h' - 1 / (2 beta))^2, h' with per-token mean log-ratios (Azar et al. 2023, eq. 17; the
             mean as TRL and the IPO authors use it, so beta means the same across answer lengths)
  SimPO (Meng et al. 2024, eq. 6), no reference: -log sigma(beta (mean log pi(y_w|x) - mean log pi(y_l|x)) - gamma)
  ORPO (Hong et al. 2024, eq. 6-7), no reference: NLL(y_w) - beta log sigma(log odds(y_w) - log odds(y_l)),
    odds(y) = P / (1 - P) with P = exp(mean log pi(y|x)); NLL(y_w) is the per-token mean of each chosen answer.

Rewards (for the metrics): DPO beta log pi/pi_ref of each answer; SimPO and ORPO beta times the mean
log-prob. ``accuracy`` is the fraction of pairs whose chosen reward is the larger, a tie counting
half (TRL's rewards/accuracies counts a tie as wrong, so it starts DPO at 0); ``prefers_chosen``
the fraction where the policy itself gives the chosen answer the higher log-probability.

The reference (DPO) is frozen and runs in eval mode without gradients: the model as it started (a
copy), with LoRA the base with the adapters switched off (``lora.disabled``, no copy), or the model
``finetune.reference`` names.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import lora
from ..nn.moe import MoEMLP
from .batches import IGNORE, Batch

# -- the losses, per pair ---------------------------------------------------------------------------


def sigmoid(h: Tensor, beta: float, eps: float) -> Tensor:
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def robust(h: Tensor, beta: float, eps: float) -> Tensor:
    return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)


def hinge(h: Tensor, beta: float, eps: float) -> Tensor:
    return torch.relu(1 - beta * h)


def ipo(h: Tensor, beta: float, eps: float) -> Tensor:
    return (h - 1 / (2 * beta)) ** 2


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012: expm1 near 0, log1p below -ln 2)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class LossType(NamedTuple):
    fn: Callable[[Tensor, float, float], Tensor]
    per_token: bool  # h from per-token mean log-ratios (ipo), not sums
    smoothing: bool  # takes label_smoothing


LOSS_TYPES = {
    "sigmoid": LossType(sigmoid, False, True),
    "robust": LossType(robust, False, True),
    "hinge": LossType(hinge, False, False),
    "ipo": LossType(ipo, True, False),
}


class Logps(NamedTuple):
    """Summed log-probabilities of each answer's tokens and how many tokens, (P,) each."""

    chosen: Tensor
    rejected: Tensor
    n_chosen: Tensor
    n_rejected: Tensor

    def mean(self) -> tuple[Tensor, Tensor]:
        return self.chosen / self.n_chosen.clamp(min=1), self.rejected / self.n_rejected.clamp(min=1)


class Terms(NamedTuple):
    loss: Tensor  # (P,) per pair
    chosen_rewards: Tensor  # (P,)
    rejected_rewards: Tensor  # (P,)
    prefers_chosen: Tensor  # (P,) bool: log pi(y_w|x) > log pi(y_l|x)


def _terms(loss: Tensor, chosen_reward: Tensor, rejected_reward: Tensor, chosen: Tensor, rejected: Tensor) -> Terms:
    return Terms(loss, chosen_reward.detach(), rejected_reward.detach(), chosen.detach() > rejected.detach())


def _number(name: str, value, low: float, high: float | None = None, *, closed: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value >= low if closed else value > low) and (high is None or value < high)
    if not ok:
        bound = f">= {low}" if closed else f"> {low}"
        allowed = bound if high is None else f"{bound} and < {high}"
        raise ValueError(f"preference.{name}={value!r}: must be a number {allowed}")


@dataclass(frozen=True)
class DPO:
    beta: float = 0.1  # the KL weight: small lets the policy move far from the reference
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0  # sigmoid and robust: the assumed rate of flipped preference labels

    reference = True

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"preference.loss_type={self.loss_type!r}: must be one of {sorted(LOSS_TYPES)}")
        _number("beta", self.beta, 0.0)
        _number("label_smoothing", self.label_smoothing, 0.0, 0.5, closed=True)
        if self.label_smoothing and not LOSS_TYPES[self.loss_type].smoothing:
            smoothed = sorted(k for k, v in LOSS_TYPES.items() if v.smoothing)
            raise ValueError(
                f"preference.label_smoothing={self.label_smoothing!r} with loss_type={self.loss_type!r}: label "
                f"smoothing applies to loss_type {smoothed} only"
            )

    def loss(self, policy: Logps, ref: Logps) -> Terms:
        kind = LOSS_TYPES[self.loss_type]
        chosen_ratio, rejected_ratio = policy.chosen - ref.chosen, policy.rejected - ref.rejected  # (P,)
        if kind.per_token:
            h = chosen_ratio / policy.n_chosen.clamp(min=1) - rejected_ratio / policy.n_rejected.clamp(min=1)
        else:
            h = chosen_ratio - rejected_ratio
        loss = kind.fn(h, self.beta, self.label_smoothing)
        return _terms(loss, self.beta * chosen_ratio, self.beta * rejected_ratio, policy.chosen, policy.rejected)


@dataclass(frozen=True)
class SimPO:
    beta: float = 2.0  # scales the length-normalised reward (the paper uses 2.0-2.5)
    gamma: float = 1.0  # the target reward margin (the paper's gamma / beta is about 0.5)
    label_smoothing: float = 0.0

    reference = False

    def __post_init__(self) -> None:
        _number("beta", self.beta, 0.0)
        _number("gamma", self.gamma, 0.0, closed=True)
        _number("label_smoothing", self.label_smoothing, 0.0, 0.5, closed=True)

    def loss(self, policy: Logps, ref: Logps | None) -> Terms:
        chosen, rejected = policy.mean()  # (P,) mean log-prob per token
        h = chosen - rejected - self.gamma / self.beta  # beta h = beta (chosen - rejected) - gamma
        loss = sigmoid(h, self.beta, self.label_smoothing)
        return _terms(loss, self.beta * chosen, self.beta * rejected, chosen, rejected)


@dataclass(frozen=True)
class ORPO:
    beta: float = 0.1  # the paper's lambda: the odds-ratio term's weight beside the chosen answer's NLL

    reference = False

    def __post_init__(self) -> None:
        _number("beta", self.beta, 0.0)

    def loss(self, policy: Logps, ref: Logps | None) -> Terms:
        chosen, rejected = policy.mean()  # (P,) log P(y|x) per token, < 0
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))  # log odds = log P - log(1 - P)
        loss = -chosen - self.beta * F.logsigmoid(log_odds)
        return _terms(loss, self.beta * chosen, self.beta * rejected, chosen, rejected)


OBJECTIVES = {"dpo": DPO, "simpo": SimPO, "orpo": ORPO}


def config(objective: str, section: dict):
    """The objective's config from the recipe's ``preference`` section (its own keys only)."""
    cls = OBJECTIVES[objective]
    if not isinstance(section, dict):
        raise ValueError(f"recipe section preference must be a mapping of settings, got {section!r}")
    allowed = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        keys = [f"preference.{k}" for k in unknown]
        raise ValueError(f"unknown key(s) {keys} for train.objective={objective!r}; allowed: {allowed}")
    return cls(**section)


# -- log-probabilities and the objective ------------------------------------------------------------


def sequence_logps(model: nn.Module, batch: Batch) -> Logps:
    """Each answer's summed token log-probabilities, from rows of prompt + answer whose labels are
    -100 outside the answer; ``batch["chosen"]`` marks the chosen rows (each followed by its rejected)."""
    logits = model(batch["ids"])  # (R, T, V)
    labels = batch["labels"]  # (R, T)
    valid = labels != IGNORE
    picked = logits.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1).float()  # (R, T)
    logp = torch.where(valid, picked - logits.float().logsumexp(-1), 0.0).sum(-1)  # (R,)
    n, chosen = valid.sum(-1), batch["chosen"]
    return Logps(logp[chosen], logp[~chosen], n[chosen], n[~chosen])


class Preference(nn.Module):
    """The training objective: the summed per-pair loss of a batch (train.py divides by the pair
    count of the global batch, as it divides token losses by the token count).

    reference: a frozen model, or None with ``config.reference`` (DPO over LoRA adapters: the
    model's own base with the adapters off)."""

    def __init__(self, model: nn.Module, config, reference: nn.Module | None = None) -> None:
        super().__init__()
        self.model, self.config, self.reference = model, config, reference
        if reference is not None:
            reference.requires_grad_(False).eval()  # frozen: no dropout, whatever the policy's mode
        self.router_losses: dict[str, Tensor] = {}  # the training loop's log reads it (MoE only)

    def train(self, mode: bool = True) -> Preference:
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self

    @torch.no_grad()
    def reference_logps(self, batch: Batch) -> Logps | None:
        if not self.config.reference:
            return None
        if self.reference is not None:
            return sequence_logps(self.reference, batch)
        was = self.model.training
        self.model.eval()  # the reference has no dropout, and draws no random numbers (bit-exact resume)
        try:
            with lora.disabled(self.model):
                return sequence_logps(self.model, batch)
        finally:
            self.model.train(was)

    def terms(self, batch: Batch) -> Terms:
        ref = self.reference_logps(batch)
        return self.config.loss(sequence_logps(self.model, batch), ref)

    def forward(self, batch: Batch, smoothing: float | None = None) -> Tensor:
        """The summed loss over the batch's pairs (``smoothing``, a token-loss setting, does not apply)."""
        return self.terms(batch).loss.sum()


def build(recipe, model: nn.Module, reference: nn.Module | None) -> Preference:
    """The objective for ``train.objective``: DPO's reference is ``reference`` (finetune.reference),
    else the base with adapters off for a LoRA run, else a frozen copy of the model as it starts."""
    cfg = config(recipe.train.objective, recipe.preference)
    if any(isinstance(m, MoEMLP) for m in model.modules()):  # its router losses are CausalLM's alone so far
        raise ValueError(
            f"train.objective={recipe.train.objective!r}: mixture-of-experts models are not supported with preference "
            "objectives yet (the router's load-balancing loss would not be trained); use a dense model"
        )
    if cfg.reference and reference is None and not lora.adapters(model):
        reference = copy.deepcopy(model)  # full fine-tuning: the starting weights, kept frozen
    return Preference(model, cfg, reference if cfg.reference else None)


@torch.no_grad()
def validate(objective: Preference, evals, device: torch.device, amp) -> dict:
    """The evaluation row: the mean loss per pair and the reward measures over the held-out pairs."""
    was = objective.training
    objective.eval()
    sums = {"val_loss": 0.0, "rewards_chosen": 0.0, "rewards_rejected": 0.0, "accuracy": 0.0, "prefers_chosen": 0.0}
    pairs = 0
    for batch in evals:
        batch = {k: v.to(device) for k, v in batch.items()}
        with amp():
            t = objective.terms(batch)
        sums["val_loss"] += float(t.loss.sum())
        sums["rewards_chosen"] += float(t.chosen_rewards.sum())
        sums["rewards_rejected"] += float(t.rejected_rewards.sum())
        # A tie counts half: a policy still equal to its reference (every reward 0) scores chance, 50%.
        ahead, tied = t.chosen_rewards > t.rejected_rewards, t.chosen_rewards == t.rejected_rewards
        sums["accuracy"] += float(ahead.sum() + 0.5 * tied.sum())
        sums["prefers_chosen"] += float(t.prefers_chosen.sum())
        pairs += len(t.loss)
    objective.train(was)
    out = {k: v / max(1, pairs) for k, v in sums.items()}
    out["reward_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
    return out
