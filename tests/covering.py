"""The covering arrays of tests/grid.py, without torch: every test process computes the same rows,
and tests/test_grid.py checks that in fresh interpreters under other hash seeds, which then start in
milliseconds instead of importing torch (~2 s of CPU each)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from functools import cache

AXES: dict[str, tuple] = {
    "arch": ("decoder", "encoder", "encoder_decoder"),
    "norm": ("layernorm", "rmsnorm"),
    "placement": ("pre", "post", "parallel", "parallel_shared"),
    "position": (
        "sinusoidal",
        "learned",
        "rope-half",
        "rope-interleaved",
        "rope-partial-yarn",
        "alibi",
        "relative_bias",
        "none",
    ),
    "mlp": ("relu", "gelu", "gelu_tanh", "swiglu", "geglu", "geglu_tanh"),
    "heads": ("mha", "gqa", "mqa"),
    "backend": ("math", "sdpa"),
    "bias": (False, True),
}


def pairwise(axes: dict[str, Sequence]) -> list[dict]:
    """A deterministic covering array: every pair of values of every two axes is in some row.

    Greedy: seed each new row with the first uncovered pair, then give every other axis the
    value that covers the most still-uncovered pairs with the values already chosen.
    """
    names = list(axes)

    def pair(x: str, vx, y: str, vy) -> tuple:  # canonical order: by axis position
        return ((x, vx), (y, vy)) if names.index(x) < names.index(y) else ((y, vy), (x, vx))

    uncovered = {pair(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in axes[a] for vb in axes[b]}
    rows = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), repr(p)))
        row = {a: va, b: vb}
        for name in names:
            if name not in row:
                row[name] = max(axes[name], key=lambda v: sum(pair(name, v, o, row[o]) in uncovered for o in row))
        uncovered -= {pair(x, row[x], y, row[y]) for x, y in itertools.combinations(names, 2)}
        rows.append({name: row[name] for name in names})
    return rows


@cache
def _rows(archs: tuple[str, ...]) -> tuple[tuple[tuple[str, object], ...], ...]:
    axes = dict(AXES, arch=archs)
    return tuple(tuple(row.items()) for row in pairwise(axes))


def variants(archs: Iterable[str] = AXES["arch"]) -> list[dict]:
    """The covering rows restricted to ``archs`` (pairwise over the other axes within them)."""
    return [dict(row) for row in _rows(tuple(archs))]


def variant_id(v: dict) -> str:
    bias = "bias" if v["bias"] else "nobias"
    keys = ("arch", "norm", "placement", "position", "mlp", "heads", "backend")
    return "-".join(str(v[k]) for k in keys) + f"-{bias}"


# Issue 14 part B axes (Gemma norms, sandwich/output norm placement, QK-norm, soft-caps and head
# scale, layer kinds) in their own covering array, so the main grid's consumers keep their meaning;
# tests/models/test_grid_quirks.py runs the core properties over it (31 rows).
QUIRK_AXES: dict[str, tuple] = {
    "arch": ("decoder", "encoder"),
    "norm": ("rmsnorm_1p", "rmsnorm", "layernorm"),
    "placement": ("sandwich", "output", "pre"),
    "position": ("rope-half", "rope-interleaved", "rope-partial-yarn", "alibi", "none"),
    "quirk": ("qk-head", "qk-width", "softcaps", "kinds", "none"),
    "heads": ("gqa", "mqa", "mha"),
    "backend": ("math", "sdpa"),
}


@cache
def _quirk_rows() -> tuple[tuple[tuple[str, object], ...], ...]:
    return tuple(tuple(row.items()) for row in pairwise(QUIRK_AXES))


def quirk_variants() -> list[dict]:
    return [dict(row) for row in _quirk_rows()]


def quirk_id(v: dict) -> str:
    return "-".join(str(v[k]) for k in QUIRK_AXES)


def rows_json(arch_sets: Iterable[Sequence[str]]) -> str:
    """The rows for each arch tuple, then the quirk rows, as JSON (compared across processes)."""
    return json.dumps([*(variants(archs) for archs in arch_sets), quirk_variants()])
