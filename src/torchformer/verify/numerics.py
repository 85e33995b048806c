"""Numerical health: a whole forward in fp16 and bf16 at the longest affordable length, and the
initial loss of an untrained model against ln(V) (uniform predictions)."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from ..analysis.accounting import flops_per_token
from .probes import Runner, looks_untrained
from .report import PASS, WARN, Row, judged, not_applicable

LOSS_TOL = 0.25  # nats: random-label loss of a fresh model is ln(V) + var(logits) / 2
CPU_FLOP_BUDGET = 3e9  # per fp16/bf16 forward on CPU (~1.5 s here: bf16 matmuls run ~1-2 GFLOP/s)


def affordable_length(r: Runner, budget: float | None) -> int:
    """The model's max_seq_len, or on CPU the longest length whose forward stays in budget."""
    top = r.cfg.max_seq_len
    if budget is None or r.device.type != "cpu":
        return top
    T = top
    while T > 16 and T * flops_per_token(r.cfg, T).forward > budget:
        T //= 2
    return T


def low_precision(r: Runner, budget: float | None = CPU_FLOP_BUDGET) -> Row:
    """No NaN/inf in fp16 and bf16 logits at the longest (affordable) length, batch 1."""
    T = affordable_length(r, budget)
    ids = r.ids(1, T)
    bad, where, drift = 0, "", 0.0
    ref = r.out(ids).float()
    original = r.model
    try:
        for dtype in (torch.float16, torch.bfloat16):
            r.model = copy.deepcopy(original).to(dtype)
            out = r.out(ids).float()
            n = int((~out.isfinite()).sum())
            if n > bad:
                bad, where = n, str(dtype).removeprefix("torch.")
            if n == 0:
                drift = max(drift, float((out - ref).abs().max() / ref.abs().max().clamp_min(1.0)))
    finally:
        r.model = original
    capped = "" if r.cfg.max_seq_len <= T else f" (max_seq_len {r.cfg.max_seq_len} capped to bound CPU cost)"
    return judged(
        "fp16/bf16 forward",
        float(bad),
        bad == 0,
        f"0 non-finite at T={T}",
        f"finite at T={T}{capped}; max rel drift vs fp32 {drift:.3g}",
        f"{bad} non-finite outputs in {where} at T={T}: an overflow in half precision "
        "(missing fp32 upcast in softmax or norm reductions?)",
    )


def initial_loss(r: Runner, untrained: bool | None) -> Row:
    """Cross-entropy of a fresh model on random labels is ~ln(V): logits start near zero."""
    guessed = untrained is None
    if guessed:
        untrained = looks_untrained(r.model)
    if not untrained:
        why = "trained model" + (" (norm weights / biases moved from init)" if guessed else "")
        return not_applicable("initial loss ~ ln(V)", why)
    ids = r.ids(2, r.T)
    labels = r.ids(2, r.T)
    out = r.out(ids)
    logits = r.model.mlm_logits(out) if r.arch == "encoder" else out
    loss = float(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))
    ln_v = math.log(r.cfg.vocab_size)
    gap = loss - ln_v
    return judged(
        "initial loss ~ ln(V)",
        gap,
        abs(gap) <= LOSS_TOL,
        f"|loss - ln V| <= {LOSS_TOL:g}",
        f"loss {loss:.3f} vs ln(V) {ln_v:.3f}",
        f"initial loss {loss:.3f} is {gap:+.3f} nats from ln(V)={ln_v:.3f}: logits at init are too large "
        "(init std, embedding scale or missing final norm)",
    )


def saturation(r: Runner, limit: float = 0.9) -> Row:
    """Mean max attention of the model's own layers on random tokens; near 1 at init is a warning."""
    from ..analysis.record import record_attention

    with record_attention(r.model) as rec:
        r.out(r.ids(2, r.T))
    top = max(float(c.weights.amax(-1).mean()) for c in rec.captures)
    keys = max(c.weights.shape[-1] for c in rec.captures)
    status = PASS if top < limit else WARN
    message = (
        f"mean max attention {top:.2f} over up to {keys} keys"
        if status == PASS
        else f"mean max attention {top:.2f} on random tokens: softmax saturated (fine for a trained model; "
        "at init it suggests a missing 1/sqrt(d_k))"
    )
    return Row("softmax saturation", top, f"< {limit:g} (warning)", status, message)
