"""Checks that run the whole model: causality, cached decoding, backend parity, padding,
relative positions. Each returns one Row; thresholds are module constants so the table and the
docs quote the same numbers."""

from __future__ import annotations

import torch

from ..configs import ALiBi, RelativeBias, RoPE
from ..nn.backends import math_attention, sdpa_attention
from ..nn.moe import MoEMLP
from ..nn.rope_scaling import one_rule_length
from .probes import PAD, Runner, backends_set_to, rel_diff
from .report import Row, judged, not_applicable

TOL = 1e-4  # fp32 equalities: max |a - b| / max(1, max |b|)


def causality(r: Runner) -> Row:
    """Changing token t must leave every output before t exactly unchanged, on the fast
    is_causal path and on the explicit-mask path (an all-ones attention_mask)."""
    if r.arch == "encoder":
        return bidirectional(r)
    ids = r.ids(2, r.T)
    worst, where, scale = 0.0, "", 0.0
    # MoE: changing a token re-routes it, so the other tokens' expert matmuls run over different row
    # counts and may differ in the last bits; a real leak of future keys is orders larger.
    moe = any(isinstance(m, MoEMLP) for m in r.model.modules())
    for mask in (None, torch.ones_like(ids)):
        base = r.out(ids, mask)
        scale = max(scale, float(base.abs().max()))
        for t in sorted({1, r.T // 2, r.T - 1}):
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 1) % r.cfg.vocab_size
            diff = float((r.out(changed, mask)[:, :t] - base[:, :t]).abs().max())
            if diff > worst:
                worst, where = (
                    diff,
                    f"token {t} changed outputs before it ({'mask' if mask is not None else 'is_causal'})",
                )
    return judged(
        "causality",
        worst,
        worst <= (1e-5 * scale if moe else 0.0),
        "<= 1e-5 x max|out| (MoE)" if moe else "== 0 exactly",
        "future tokens never change earlier outputs",
        f"{where}: queries see future keys (causal mask diagonal off by one?)",
    )


def bidirectional(r: Runner) -> Row:
    """Encoders: the first output must depend on the last token (no causal mask by mistake)."""
    ids = r.ids(2, r.T)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % r.cfg.vocab_size
    diff = float((r.out(changed)[:, 0] - r.out(ids)[:, 0]).abs().max())
    return judged(
        "bidirectional",
        diff,
        diff > 0,
        "> 0",
        "encoder outputs see every token",
        "the first output ignores the last token: the encoder applies a causal mask",
    )


def cached_equals_uncached(r: Runner) -> Row:
    """Prefill half, then one token at a time through the static cache == one full forward;
    also for a left-padded batch (prefill with the mask and counted positions, as generation does)."""
    if r.arch == "encoder":
        return not_applicable("cached == uncached", "encoders do not decode")
    ids = r.ids(2, r.T)
    padded, mask = r.padded(ids)
    plain = rel_diff(_decode_in_steps(r, ids, None), r.out(ids))
    real = mask.bool()
    left = rel_diff(_decode_in_steps(r, padded, mask)[real], r.out(padded, mask)[real])
    diff = max(plain, left)
    where = "left-padded batch" if left > plain else "unpadded batch"
    return judged(
        "cached == uncached",
        diff,
        diff <= TOL,
        f"<= {TOL:g} rel",
        "cached decoding equals full recomputation (plain and left-padded)",
        f"cached decoding differs from full recomputation ({where}): cache slots, positions or the cache mask",
    )


def _decode_in_steps(r: Runner, ids, mask):
    """Outputs of a half-length prefill then single-token steps through a fresh cache."""
    m = r.model
    if r.arch == "decoder":
        cache = m.new_cache(2, r.T)
        step = lambda x, pos, am: m(x, positions=pos, attention_mask=am, cache=cache)  # noqa: E731
    else:
        cache = m.new_cache(2, r.T, memory=m.encode(r.src))
        step = lambda x, pos, am: m.decode(x, positions=pos, attention_mask=am, cache=cache)  # noqa: E731
    pos = torch.arange(r.T, device=r.device).expand(2, -1) if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    cut = r.T // 2
    parts = [step(ids[:, :cut], pos[:, :cut], None if mask is None else mask[:, :cut])]
    parts += [step(ids[:, t : t + 1], pos[:, t : t + 1], None) for t in range(cut, r.T)]
    return torch.cat(parts, dim=1)


def backend_parity(r: Runner) -> Row:
    """All layers on the math reference == all on SDPA == the model as built, padded batch."""
    ids, mask = r.padded(r.ids(2, r.T))
    outs = {}
    for name, backend in (("built", None), ("math", math_attention), ("sdpa", sdpa_attention)):
        if backend is None:
            outs[name] = (r.out(ids, mask), r.out(ids))
        else:
            with backends_set_to(r.model, backend):
                outs[name] = (r.out(ids, mask), r.out(ids))
    pairs = [("math", "sdpa"), ("built", "math")]
    diffs = {f"{a} vs {b}": max(rel_diff(x, y) for x, y in zip(outs[a], outs[b])) for a, b in pairs}
    worst = max(diffs, key=diffs.get)
    return judged(
        "math == sdpa",
        diffs[worst],
        diffs[worst] <= TOL,
        f"<= {TOL:g} rel",
        "math reference, SDPA and the built backend agree",
        f"{worst} differ by {diffs[worst]:.3g}: the attention backend computes a different function",
    )


def padding_invariance(r: Runner) -> Row:
    """A padded row's real-token outputs == the same row alone, unpadded. Decoders pad on the
    left, encoders on the right; encoder-decoders pad the source (src_mask)."""
    ids = r.ids(2, r.T)
    if r.arch == "encoder_decoder":
        src_mask = torch.ones_like(r.src)
        src_mask[1, -min(PAD, r.T - 1) :] = 0  # sources pad on the right
        keep = src_mask[1].bool()
        src = r.src.masked_fill(src_mask == 0, r.cfg.pad_token_id or 0)
        got = r.out(ids, src=src, src_mask=src_mask)[1]
        want = r.out(ids[1:2], src=src[1:2, keep])[0]
    else:
        padded, mask = r.padded(ids)
        keep = mask[1].bool()
        got = r.out(padded, mask)[1, keep]
        want = r.out(padded[1:2, keep])[0]
    diff = rel_diff(got, want)
    return judged(
        "padding invariance",
        diff,
        diff <= TOL,
        f"<= {TOL:g} rel",
        "a padded row equals the row alone",
        "padding changes the real tokens' outputs: the padding mask or per-row positions are wrong",
    )


def relative_positions(r: Runner) -> Row:
    """RoPE (and ALiBi, relative bias) see only offsets: shifting every position by s must not
    change the outputs; plus the rotation's own property <R_m q, R_n k> = f(m - n)."""
    pos = r.cfg.positions
    if not isinstance(pos, RoPE | ALiBi | RelativeBias):
        return not_applicable("relative positions", f"positions are {type(pos).__name__ if pos else 'None'}")
    room = relative_room(r)
    # A length-dependent RoPE (room < max_seq_len) is checked below its original length.
    T = r.T if room == r.cfg.max_seq_len else min(r.T, room // 2)
    shift = min(37, room - T)
    if T < 2 or shift < 1:
        return not_applicable("relative positions", f"a purely relative length of {room} leaves no room to shift")
    ids = r.ids(2, T)
    base = torch.arange(T, device=r.device)
    diff = rel_diff(r.out(ids, positions=base + shift), r.out(ids, positions=base))
    if isinstance(pos, RoPE):
        diff = max(diff, rope_offset_error(r))
    return judged(
        "relative positions",
        diff,
        diff <= TOL,
        f"<= {TOL:g} rel",
        "outputs depend only on relative offsets",
        "shifting all positions changes the outputs: the rotation (or bias) depends on absolute positions",
    )


def relative_room(r: Runner) -> int:
    """The longest length whose outputs depend only on offsets: max_seq_len, or less for RoPE
    tables that choose frequencies by the current length (dynamic NTK, LongRoPE: up to their
    original length, ``relative_up_to``)."""
    limit = one_rule_length(r.model)
    return r.cfg.max_seq_len if limit is None else min(r.cfg.max_seq_len, limit)


def rope_offset_error(r: Runner) -> float:
    """max over offset-preserving shifts of |<R_m q, R_n k> - <R_m' q, R_n' k>| / |q||k|."""
    stacks = [s for s in r.model.modules() if getattr(s, "rope", None) is not None and hasattr(s, "blocks")]
    stack = stacks[0]
    rotate = stack.blocks[0].attn.rotate
    E = r.cfg.head_dim
    q, k = torch.randn(2, 1, 1, 1, E, generator=r.gen).to(r.device)
    top = relative_room(r) - 1
    pairs = [(5, 2), (9, 6), (top, top - 3)]

    def score(m: int, n: int) -> float:
        pm, pn = stack.rope(torch.tensor([[m]], device=r.device)), stack.rope(torch.tensor([[n]], device=r.device))
        return float((rotate(q, *pm) * rotate(k, *pn)).sum())

    scores = [score(m, n) for m, n in pairs]
    norm = float(q.norm() * k.norm())
    return max(abs(s - scores[0]) for s in scores) / norm
