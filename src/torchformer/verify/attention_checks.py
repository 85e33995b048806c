"""Checks on the attention itself: masked keys get exactly zero weight (recorded weights), the
1/sqrt(d_k) scale (unit-variance probe through each layer's own backend and scale), and fp16
headroom of the backend on large scores.

Legend: B batch, H query heads, K kv heads, T queries, S keys, E head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..analysis.record import record_attention
from ..nn.backends import math_attention
from .probes import PAD, Runner, attention_modules
from .report import FAIL, PASS, Row

SUM_TOL = 1e-5  # visible rows of a softmax sum to 1 in fp32
SCALE_BAND = (0.5, 2.0)  # std of scaled unit-variance scores; 1/sqrt(d_k) gives 1.0
FP16_SCORE = 2.0**17  # largest |q.k| of the fp16 probe: twice fp16's max (65504)
LOW_TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _allowed(r: Runner, kind: str, stack: str, T: int, S: int, q_mask, k_mask) -> Tensor:
    """Reference visibility (B, 1, T, S) built from the inputs, independent of the model's masks."""
    allowed = torch.ones(1, 1, T, S, dtype=torch.bool, device=r.device)
    if k_mask is not None:
        allowed = allowed & k_mask.bool()[:, None, None, :]
    causal_self = kind == "self" and stack in ("stack", "decoder") and r.arch != "encoder"
    if causal_self:
        i, j = torch.arange(T, device=r.device)[:, None], torch.arange(S, device=r.device)[None, :]
        allowed = allowed & (j <= i)
        window = r.cfg.attention.sliding_window
        if window is not None:
            allowed = allowed & (i - j < window)
    return allowed


def masked_keys(r: Runner) -> Row:
    """Recorded weights: exactly 0 on every key the inputs forbid (future, padding, outside the
    window), and each real query's row sums to 1 (it sees at least itself)."""
    ids = r.ids(2, r.T)
    padded, mask = r.padded(ids)
    src_mask = None
    if r.arch == "encoder_decoder":
        src_mask = torch.ones_like(r.src)
        src_mask[1, -min(PAD, r.T - 1) :] = 0
    found = [(0.0, 0.0, "")]
    for x, m, sm in ((ids, None, None), (padded, mask, src_mask)):
        with record_attention(r.model) as rec:
            r.out(x, m, src_mask=sm)
        found += [_capture_faults(r, c, m, sm) for c in rec.captures]
    forbidden = max(f[0] for f in found)
    row_err = max(f[1] for f in found)
    fault = max(found, key=lambda f: (f[0], f[1]))[2]
    ok = forbidden == 0.0 and row_err <= SUM_TOL
    message = "masked keys get exactly zero weight; visible rows sum to 1" if ok else fault
    return Row("masked keys zero weight", forbidden, f"== 0; rows sum 1 +- {SUM_TOL:g}", PASS if ok else FAIL, message)


def _capture_faults(r: Runner, c, m, sm) -> tuple[float, float, str]:
    """(largest forbidden weight, largest row-sum error of real queries, the fault named) of one capture."""
    B, H, T, S = c.weights.shape
    is_src = c.stack == "encoder" or c.kind == "cross"
    q_mask = sm if c.stack == "encoder" else m
    allowed = _allowed(r, c.kind, c.stack, T, S, q_mask, sm if is_src else m)
    w = c.weights.float()
    forbidden = float((w * ~allowed).abs().max())
    rows = torch.ones(B, 1, T, dtype=torch.bool, device=r.device) if q_mask is None else q_mask.bool()[:, None]
    row_err = float(((w.sum(-1) - 1).abs() * rows).max())
    if forbidden > 0:
        return forbidden, row_err, _forbidden_fault(c.name, w, allowed, T, S)
    fault = (
        f"{c.name}: a real query's weights sum to {1 - row_err:.3g}, not 1: it sees no key, "
        "not even itself (causal mask diagonal off by one: query i cannot see key i)"
    )
    return forbidden, row_err, fault if row_err > SUM_TOL else ""


def _forbidden_fault(name: str, w: Tensor, allowed: Tensor, T: int, S: int) -> str:
    """Name the fault from where the forbidden weight sits."""
    i = torch.arange(T, device=w.device)[:, None]
    j = torch.arange(S, device=w.device)[None, :]
    future = ((w * ~allowed) * (j > i)).abs().max() > 0
    if future and T == S:
        return f"{name}: future keys get weight (causal mask diagonal off by one: query i sees key i+1)"
    return f"{name}: masked (padding or out-of-window) keys get nonzero weight: the mask is not applied"


def recovered_weights(module, q: Tensor, k: Tensor, **kwargs) -> Tensor:
    """The (B, H, T, S) weights a backend uses, from outputs alone: values one-hot over E keys
    at a time make out[..., c] = a[..., key c] (works for SDPA, which never returns weights)."""
    B, K, S, E = k.shape
    chunks = []
    for start in range(0, S, E):
        n = min(E, S - start)
        v = torch.zeros(B, K, S, E, dtype=q.dtype, device=q.device)
        v[:, :, start : start + n, :n] = torch.eye(n, dtype=q.dtype, device=q.device)
        out = module.backend(q, k, v, mask=None, bias=None, is_causal=False, dropout_p=0.0, **kwargs)
        chunks.append(out[..., :n])
    return torch.cat(chunks, dim=-1)  # (B, H, T, S)


def score_scale(r: Runner, n_keys: int = 64) -> Row:
    """Unit-variance q, k through each layer's backend and scale: the scaled scores must have
    std ~1 (Vaswani 2017, 3.2.1). Missing scaling gives sqrt(d_k); softmax then saturates."""
    worst, worst_name, saturation = 1.0, "", 0.0
    names = {id(m): n for n, m in r.model.named_modules()}
    for module in attention_modules(r.model):
        H, K, E = module.n_heads, module.n_kv_heads, module.head_dim
        q = torch.randn(1, H, 16, E, generator=r.gen).to(r.device)
        k = torch.randn(1, K, n_keys, E, generator=r.gen).to(r.device)
        w = recovered_weights(module, q, k, scale=module.scale).float()
        # log a_ij = s_ij - logsumexp_i: its spread over keys is the scores' spread.
        std = float(w.clamp_min(1e-38).log().std(dim=-1).mean())
        # A configured scale (attention.scale: T5 1.0, Gemma 2) sets the expected std to
        # scale * sqrt(d_k); the check then measures the ratio to what the config asks for.
        std /= 1.0 if r.cfg.attention.scale is None else r.cfg.attention.scale * math.sqrt(E)
        saturation = max(saturation, float(w.amax(-1).mean()))
        if abs(math.log(std)) > abs(math.log(worst)):
            worst, worst_name = std, names[id(module)]
    lo, hi = SCALE_BAND
    ok = lo <= worst <= hi
    E = r.cfg.head_dim
    fault = (
        f"{worst_name}: scores of unit-variance q, k have std {worst:.3g} (1/sqrt(d_k) gives 1, none gives "
        f"sqrt(d_k)={math.sqrt(E):.3g}); mean max attention {saturation:.2f}: the 1/sqrt(d_k) scaling is "
        + ("missing" if worst > hi else "wrong")
    )
    good = f"scaled scores have std ~1; mean max attention {saturation:.2f} on {n_keys} random keys"
    return Row("score scale", worst, f"{lo:g}..{hi:g} (1.0)", PASS if ok else FAIL, good if ok else fault)


def fp16_headroom(r: Runner) -> Row:
    """Each backend in fp16 and bf16 on q, k whose dot products reach 2^17 (beyond fp16's
    range; realistic for outlier features) must stay finite and match the fp32 reference."""
    worst, fault = 0.0, ""
    names = {id(m): n for n, m in r.model.named_modules()}
    for module in attention_modules(r.model):
        H, K, E = module.n_heads, module.n_kv_heads, module.head_dim
        k = torch.randn(1, K, 32, E, generator=r.gen).sign().to(r.device) * math.sqrt(FP16_SCORE / E)
        q = k.repeat_interleave(H // K, dim=1)  # each query head aligned with its kv head
        v = torch.randn(1, K, 32, E, generator=r.gen).to(r.device)
        ref = math_attention(q, k, v, is_causal=True, scale=module.scale)
        for dtype, tol in LOW_TOL.items():
            args = dict(mask=None, bias=None, is_causal=True, scale=module.scale, dropout_p=0.0)
            out = module.backend(q.to(dtype), k.to(dtype), v.to(dtype), **args).float()
            err = float("inf") if not bool(out.isfinite().all()) else float((out - ref).abs().max()) / tol
            if err > worst:
                worst = err
                fault = (
                    f"{names[id(module)]} in {str(dtype).removeprefix('torch.')}: "
                    + ("NaN/inf where the fp32 reference is finite" if err == float("inf") else "far from fp32")
                    + ": scores or softmax computed in half precision without an fp32 upcast"
                )
    ok = worst <= 1.0
    good = "attention stays finite and accurate in fp16/bf16 at |q.k| = 2^17"
    return Row("fp16/bf16 attention", worst, "<= 1 (error / tolerance)", PASS if ok else FAIL, good if ok else fault)
