"""Changing token t changes no logit before t: exactly 0.0, for every causal grid row, on the
is_causal fast path and on the explicit-mask path; and broken masks are caught by the check."""

import pytest
import torch

import torchformer.models.stack as stack_module

from .. import grid

CAUSAL = grid.variants(("decoder", "encoder_decoder"))
T = 12


def leaks(model, ids, t, mask=None) -> tuple[float, float]:
    """Max |change| of outputs before t and at/after t when token t is replaced."""
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % grid.VOCAB
    with torch.no_grad():
        a, b = grid.forward(model, ids, mask), grid.forward(model, changed, mask)
    return (a[:, :t] - b[:, :t]).abs().max().item(), (a[:, t:] - b[:, t:]).abs().max().item()


@pytest.mark.parametrize("v", **grid.params(CAUSAL))
def test_changing_token_t_changes_no_earlier_logit(v):
    model = grid.build(v)
    ids = torch.randint(0, grid.VOCAB, (2, T))
    for mask in (None, torch.ones(2, T, dtype=torch.long)):  # fast path, then the mask path
        for t in (1, 6, T - 1):
            before, after = leaks(model, ids, t, mask)
            assert before == 0.0, f"token {t} leaked into earlier logits by {before}"
            assert after > 0.0


BROKEN = grid.variants(("decoder",))[:4]
# Rows without a score bias take the is_causal fast path when no mask is given.
FAST = [v for v in grid.variants(("decoder",)) if v["position"] not in ("alibi", "relative_bias")][:4]


@pytest.mark.parametrize("v", **grid.params(BROKEN))
def test_check_catches_a_mask_with_the_wrong_diagonal(v, monkeypatch):
    """A causal mask shifted by one (each query also sees the next token) must fail the check."""
    model = grid.build(v)
    ids = torch.randint(0, grid.VOCAB, (2, T))
    monkeypatch.setattr(stack_module, "causal", lambda qp, kp: lambda b, h, q, kv: kp[b, kv] <= qp[b, q] + 1)
    before, _ = leaks(model, ids, 6, torch.ones(2, T, dtype=torch.long))
    assert before > 0.0


@pytest.mark.parametrize("v", **grid.params(FAST))
def test_check_catches_a_stack_that_drops_is_causal(v, monkeypatch):
    model = grid.build(v)
    ids = torch.randint(0, grid.VOCAB, (2, T))
    original = stack_module.Stack.context
    def dropped(*a):  # every layer kind's context loses is_causal (forward reads ctx.by_kind)
        ctx = original(*a)
        return ctx._replace(is_causal=False, by_kind=tuple(c._replace(is_causal=False) for c in ctx.by_kind))

    monkeypatch.setattr(stack_module.Stack, "context", dropped)
    before, _ = leaks(model, ids, 6)
    assert before > 0.0
