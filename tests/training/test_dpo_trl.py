"""Issue 30: the preference losses equal TRL's on the same batch, loss and gradients within 1e-5.

TRL (a test-only reference, the `dev` extra) has no standalone DPO loss function since 1.x: the
loss is computed inside ``DPOTrainer._compute_loss(model, inputs)`` from the per-token log-probs the
model returns. We drive that method as it is, on a trainer object holding only the settings it
reads, with a stand-in model that returns given per-token log-probs (a leaf tensor) and precomputed
reference log-probs, so both sides differentiate the same leaf. SimPO and ORPO's odds-ratio term
compare with TRL's ``CPOTrainer.cpo_loss`` and ``ORPOTrainer.odds_ratio_loss``.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from torchformer.training.preference import DPO, ORPO, Logps, SimPO

trl = pytest.importorskip("trl")

P, T = 6, 12  # pairs, tokens per row


def _batch(seed: int = 0):
    """Per-token log-probs (2P, T - 1) of rows [chosen..., rejected...] (TRL's order), a completion
    mask of varying prompt and answer lengths, and reference sequence log-probs."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * P, T, dtype=torch.long)
    for r in range(2 * P):
        start = int(torch.randint(1, 5, (), generator=g))
        end = int(torch.randint(start + 1, T + 1, (), generator=g))
        mask[r, start:end] = 1
    per_token = (-torch.rand(2 * P, T - 1, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ref = -torch.rand(2 * P, generator=g, dtype=torch.float64) * 3 * mask.sum(1)
    return per_token, mask, ref


class _Model(torch.nn.Module):
    """Stands in for the HF model TRL calls: the given per-token log-probs, zero where no label."""

    def __init__(self, per_token, shift_mask):
        super().__init__()
        self.per_token, self.shift_mask = per_token, shift_mask

    def forward(self, **kwargs):
        logp = self.per_token * self.shift_mask
        zeros = torch.zeros_like(logp)
        return SimpleNamespace(log_probs=logp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def _trl_dpo_loss(per_token, mask, ref, *, beta, loss_type, label_smoothing):
    from trl import DPOTrainer

    trainer = DPOTrainer.__new__(DPOTrainer)  # the settings _compute_loss reads, nothing else
    model = _Model(per_token, mask[:, 1:])
    acc = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer.__dict__.update(
        model=model, accelerator=acc, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=label_smoothing, use_weighting=False, _tp_size=1, _total_train_tokens=0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )  # fmt: skip
    inputs = {"input_ids": torch.zeros(2 * P, T, dtype=torch.long), "attention_mask": torch.ones(2 * P, T),
              "completion_mask": mask, "ref_chosen_logps": ref[:P], "ref_rejected_logps": ref[P:]}  # fmt: skip
    return trainer._compute_loss(model, inputs, return_outputs=False), trainer._metrics["train"]


def _ours(per_token, mask, ref):
    """Our sequence log-probs from the same leaf: sums over each answer's tokens."""
    sums, n = (per_token * mask[:, 1:]).sum(1), mask[:, 1:].sum(1)
    policy = Logps(sums[:P], sums[P:], n[:P], n[P:])
    reference = Logps(ref[:P], ref[P:], n[:P], n[P:])
    return policy, reference


@pytest.mark.parametrize(
    "loss_type,beta,smoothing",
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.0), ("hinge", 0.1, 0.0), ("ipo", 0.1, 0.0), ("ipo", 1.0, 0.0),
     ("robust", 0.1, 0.1), ("robust", 0.3, 0.2)],
)  # fmt: skip
def test_dpo_loss_and_gradients_equal_trl(loss_type, beta, smoothing):
    per_token, mask, ref = _batch()
    theirs, metrics = _trl_dpo_loss(per_token, mask, ref, beta=beta, loss_type=loss_type, label_smoothing=smoothing)
    (grad_theirs,) = torch.autograd.grad(theirs, per_token)
    terms = DPO(beta=beta, loss_type=loss_type, label_smoothing=smoothing).loss(*_ours(per_token, mask, ref))
    ours = terms.loss.mean()  # train.py: the summed loss over the global batch's pair count
    (grad_ours,) = torch.autograd.grad(ours, per_token)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-5)
    torch.testing.assert_close(grad_ours, grad_theirs, atol=1e-5, rtol=0)
    assert grad_ours.abs().sum() > 0  # a real gradient, not zero against zero
    # the rewards the metrics report are TRL's rewards/chosen and rewards/rejected
    assert float(terms.chosen_rewards.mean()) == pytest.approx(metrics["rewards/chosen"][0], abs=1e-6)
    assert float(terms.rejected_rewards.mean()) == pytest.approx(metrics["rewards/rejected"][0], abs=1e-6)


def test_label_smoothing_is_conservative_dpo():
    """TRL 1.x's sigmoid takes no label smoothing; ours is cDPO (Mitchell 2023): the sigmoid loss
    against labels flipped with probability eps, i.e. (1 - eps) L(h) + eps L(-h)."""
    per_token, mask, ref = _batch(1)
    policy, reference = _ours(per_token, mask, ref)
    eps, beta = 0.2, 0.3
    smoothed = DPO(beta=beta, label_smoothing=eps).loss(policy, reference).loss
    plain = DPO(beta=beta).loss(policy, reference).loss
    flipped = DPO(beta=beta).loss(Logps(policy.rejected, policy.chosen, policy.n_rejected, policy.n_chosen),
                                  Logps(reference.rejected, reference.chosen, reference.n_rejected,
                                        reference.n_chosen)).loss  # fmt: skip
    torch.testing.assert_close(smoothed, (1 - eps) * plain + eps * flipped, atol=1e-12, rtol=0)


def _mean_logps(seed):
    g = torch.Generator().manual_seed(seed)
    chosen = (-torch.rand(P, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    rejected = (-torch.rand(P, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    return chosen, rejected, torch.ones(P, dtype=torch.long)


@pytest.mark.parametrize("beta,gamma,smoothing", [(2.0, 1.0, 0.0), (2.5, 1.2, 0.0), (2.0, 0.5, 0.1)])
def test_simpo_equals_trl_cpo_simpo(beta, gamma, smoothing):
    from trl.experimental.cpo import CPOTrainer

    chosen, rejected, ones = _mean_logps(2)
    trainer = CPOTrainer.__new__(CPOTrainer)
    acc = SimpleNamespace(device=torch.device("cpu"))
    trainer.__dict__.update(alpha=0.0, beta=beta, simpo_gamma=gamma, label_smoothing=smoothing, loss_type="simpo",
                            accelerator=acc)  # fmt: skip
    theirs = trainer.cpo_loss(chosen, rejected)[0].mean()
    ours = SimPO(beta=beta, gamma=gamma, label_smoothing=smoothing).loss(Logps(chosen, rejected, ones, ones), None)
    ours = ours.loss.mean()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-5)
    for a, b in zip(torch.autograd.grad(ours, (chosen, rejected)), torch.autograd.grad(theirs, (chosen, rejected))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_odds_ratio_term_equals_trl(beta):
    """ORPO = NLL(chosen) - TRL's odds_ratio_loss (beta log sigma(log odds)); the NLL here is the
    per-token mean of each chosen answer (TRL pools the chosen tokens of the batch: equal when
    every answer has one length, as here)."""
    from trl.experimental.orpo import ORPOTrainer

    chosen, rejected, ones = _mean_logps(3)
    trainer = ORPOTrainer.__new__(ORPOTrainer)
    trainer.__dict__.update(beta=beta, accelerator=SimpleNamespace(device=torch.device("cpu")))
    odds_term = trainer.odds_ratio_loss(chosen, rejected)[0]
    theirs = (-chosen - odds_term).mean()
    ours = ORPO(beta=beta).loss(Logps(chosen, rejected, ones, ones), None).loss.mean()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-5)
    for a, b in zip(torch.autograd.grad(ours, (chosen, rejected)), torch.autograd.grad(theirs, (chosen, rejected))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
