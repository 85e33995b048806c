"""The core properties over the issue-14 part B covering array (grid.quirk_variants: Gemma's
(1 + w) norms, sandwich and output norm placements, QK-norm per head and over the width,
soft-caps with head scale and in-dtype embedding scale, layer kinds with a window, their own RoPE
and NoPE): math == sdpa, exact causality, cached == full, a left-padded batch == its rows alone,
and (sampled rows) verify."""

from __future__ import annotations

import pytest
import torch

import torchformer as tfm

from .. import grid

ROWS = grid.quirk_variants()
DECODERS = [v for v in ROWS if v["arch"] == "decoder"]
TOL = 2e-5


def params(rows):
    return {"argvalues": rows, "ids": [grid.quirk_id(v) for v in rows]}


def build(v: dict, backend: str | None = None) -> torch.nn.Module:
    cfg = grid.quirk_config(v if backend is None else dict(v, backend=backend))
    torch.manual_seed(0)
    model = tfm.build_model(cfg).eval()
    with torch.no_grad():  # sharp scores and non-trivial norm weights, so every quirk matters
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(std=0.3)
            elif "norm" in name:
                p.normal_(mean=float(cfg.block.norm != "rmsnorm_1p"), std=0.2)
    return model


def ids_and_mask(batch: int = 3, length: int = 10):
    ids = torch.randint(0, grid.VOCAB, (batch, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :6] = 0, 0
    return ids, mask


def test_the_array_covers_every_pair():
    assert len(ROWS) <= 40 and {v["quirk"] for v in DECODERS} == set(grid.QUIRK_AXES["quirk"])


@pytest.mark.parametrize("v", **params(ROWS))
@torch.no_grad()
def test_math_equals_sdpa(v):
    ids, mask = ids_and_mask()
    a, b = build(v, "math"), build(v, "sdpa")
    real = mask.bool()
    assert (a(ids, attention_mask=mask)[real] - b(ids, attention_mask=mask)[real]).abs().max() < TOL


@pytest.mark.parametrize("v", **params(DECODERS))
@torch.no_grad()
def test_causal_cached_and_padding_invariant(v):
    model = build(v)
    ids, mask = ids_and_mask()
    full = model(ids, attention_mask=mask)
    # Exact causality: changing token 6 changes no earlier logit of row 0.
    changed = ids.clone()
    changed[0, 6] = (changed[0, 6] + 1) % grid.VOCAB
    assert torch.equal(model(changed, attention_mask=mask)[0, :6], full[0, :6])
    # Cached: a prefill of 4, then one token at a time, left padding kept in the cache.
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = model.new_cache(3, 32)
    outs = [model(ids[:, :4], positions=pos[:, :4], attention_mask=mask[:, :4], cache=cache)]
    for t in range(4, 10):
        outs.append(
            model(ids[:, t : t + 1], positions=pos[:, t : t + 1], attention_mask=mask[:, t : t + 1], cache=cache)
        )
    real = mask.bool()
    assert (torch.cat(outs, 1)[real] - full[real]).abs().max() < TOL
    # A left-padded row == the row alone.
    alone = model(ids[2:, 6:])
    assert (full[2, 6:] - alone[0]).abs().max() < TOL


@pytest.mark.parametrize("v", **params(DECODERS[::3]))
def test_verify_passes(v):
    report = tfm.verify(build(v), untrained=False, flop_budget=3e7)
    assert report.ok, report.table()
