"""Issue 4, test 5 (losses and masking): label smoothing equals a hand computation; MLM masking
hits its proportions over a large batch; special tokens are never masked."""

import pytest
import torch

from torchformer.training.batches import IGNORE, mlm_mask
from torchformer.training.losses import token_loss


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothing_matches_hand_computation(eps):
    g = torch.Generator().manual_seed(1)
    V = 7
    logits = torch.randn(3, 5, V, generator=g)
    labels = torch.randint(0, V, (3, 5), generator=g)
    labels[0, :2] = IGNORE  # padding positions carry no loss
    total = 0.0
    for b in range(3):
        for t in range(5):
            y = int(labels[b, t])
            if y == IGNORE:
                continue
            logp = [float(v) for v in torch.log_softmax(logits[b, t].double(), -1)]
            # target distribution: 1 - eps on the label plus eps spread evenly over all V classes
            q = [eps / V + (1 - eps if k == y else 0.0) for k in range(V)]
            total += -sum(qk * lk for qk, lk in zip(q, logp))
    assert float(token_loss(logits, labels, eps)) == pytest.approx(total, rel=1e-5)


def test_mlm_masking_proportions():
    g = torch.Generator().manual_seed(0)
    lo, hi, mask_id = 5, 100, 3
    ids = torch.randint(lo, hi, (256, 512), generator=g)
    ids[:, :8] = 1  # special tokens (e.g. <s>) must never be chosen
    out = mlm_mask(ids, torch.Generator().manual_seed(1), mask_id=mask_id, ordinary=(lo, hi), p=0.15)
    chosen = out["labels"] != IGNORE
    assert not chosen[:, :8].any()
    eligible = ids[:, 8:].numel()
    n = int(chosen.sum())
    assert n / eligible == pytest.approx(0.15, abs=0.005)
    assert torch.equal(out["labels"][chosen], ids[chosen])  # labels are the original tokens
    masked = (out["ids"] == mask_id) & chosen
    kept = (out["ids"] == ids) & chosen
    replaced = chosen & ~masked & ~kept
    assert int(masked.sum()) / n == pytest.approx(0.8, abs=0.01)
    # a random replacement can draw the original token (1/95): it then counts as kept
    assert int(kept.sum()) / n == pytest.approx(0.1 + 0.1 / 95, abs=0.01)
    assert int(replaced.sum()) / n == pytest.approx(0.1 - 0.1 / 95, abs=0.01)
    assert ((out["ids"][replaced] >= lo) & (out["ids"][replaced] < hi)).all()
    assert torch.equal(out["ids"][~chosen], ids[~chosen])  # unchosen tokens untouched
