"""The guard every generation-equality test uses (issue 33).

A tiny random model under greedy decoding often falls into one token repeated (or a short cycle),
and two such sequences agree whatever the path under test does, as long as it keeps that argmax:
a broken cache, draft, lookup or compiled step can pass. So an equality test first picks inputs
(prompts, a model seed) whose greedy continuation is varied, then asserts the sequences it
compares have many distinct tokens: ``assert_varied``, at least half as many as their length
unless the test says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _rows(tokens) -> list[list[int]]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    tokens = list(tokens)
    return [list(r) for r in tokens] if tokens and isinstance(tokens[0], Sequence) else [tokens]


def distinct(tokens) -> int:
    """The fewest distinct tokens in a row of ``tokens`` (a sequence, or (B, N) rows)."""
    return min(len(set(r)) for r in _rows(tokens))


def assert_varied(tokens, min_distinct: int | None = None, what: str = "generated tokens") -> None:
    """Every row of ``tokens`` ((N,) or (B, N), tensor or lists) has at least ``min_distinct``
    distinct tokens (default: half its length, rounded up): the sequence an equality test compares
    is not one token repeated nor a short cycle."""
    for row in _rows(tokens):
        need = math.ceil(len(row) / 2) if min_distinct is None else min_distinct
        assert len(row) >= need, f"{what}: only {len(row)} tokens, need {need} distinct: {row}"
        assert len(set(row)) >= need, f"{what} are degenerate ({len(set(row))} distinct, need {need}): {row}"


def most_varied(continuations, k: int = 1) -> list[int]:
    """Indices of the ``k`` rows of ``continuations`` with the most distinct tokens (first wins ties)."""
    rows = _rows(continuations)
    return sorted(range(len(rows)), key=lambda i: -len(set(rows[i])))[:k]


def varied_case(
    make, candidates: torch.Tensor, n_new: int, min_distinct: int, seeds=range(4), rows: int = 1, **generate_kw
):
    """(model, prompts (rows, T)): the first ``make(seed)`` model (``seeds``: any values ``make``
    takes) for which ``rows`` of the candidate prompts (R, T) have plain greedy continuations of
    ``n_new`` tokens with at least ``min_distinct`` distinct tokens each, and the most varied such
    prompts (in candidate order: with rows == R, all of them, e.g. a batch with its own mask).
    Plain ``generate`` only chooses the inputs here; the test still asserts that the sequences it
    compares are varied."""
    import torchformer as tfm

    best = []
    for seed in seeds:
        model = make(seed)
        out = tfm.generate(model, candidates, max_new_tokens=n_new, **generate_kw)[:, -n_new:]
        pick = sorted(most_varied(out, rows))  # in candidate order
        if distinct(out[pick]) >= min_distinct:
            return model, candidates[pick]
        best.append(distinct(out[pick]))
    raise AssertionError(f"no seed in {list(seeds)} gives {min_distinct} distinct greedy tokens (best: {best})")
