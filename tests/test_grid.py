"""The covering array in tests/grid.py really covers every pair, is the same in every process
(whatever the hash seed), and every row builds."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import covering, grid


@pytest.mark.parametrize("archs", [grid.AXES["arch"], ("decoder", "encoder_decoder"), ("decoder",)])
def test_every_pair_of_values_is_covered(archs):
    rows = grid.variants(archs)
    axes = dict(grid.AXES, arch=archs)
    for a, b in itertools.combinations(axes, 2):
        seen = {(r[a], r[b]) for r in rows}
        missing = set(itertools.product(axes[a], axes[b])) - seen
        assert not missing, f"pairs of {a} x {b} not covered: {sorted(missing, key=repr)}"
    # Far fewer rows than the full product, and no more than ~1.3x the lower bound (largest two axes).
    assert len(rows) <= 1.3 * 8 * 5


ROOT = Path(__file__).parent.parent
HASH_SEEDS = ("0", "1", "12345")
# The arch tuples the suite passes to grid.variants (grep "variants((" tests).
ARCHS = [covering.AXES["arch"], ("decoder",), ("encoder",), ("encoder_decoder",), ("decoder", "encoder_decoder")]


def in_processes(code: str) -> list[str]:
    """stdout of ``code`` in a fresh interpreter per PYTHONHASHSEED, as pytest-xdist workers are."""
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": seed},
                         stdout=subprocess.PIPE, text=True)
        for seed in HASH_SEEDS
    ]  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


def test_rows_are_the_same_in_every_process():
    """xdist workers must collect the same parametrized ids: rows may not depend on hash order."""
    here = covering.rows_json(ARCHS)  # every covering array the suite parametrizes over
    assert grid.variants is covering.variants and grid.quirk_variants is covering.quirk_variants  # what the suite uses
    # The children import the torch-free rows alone (milliseconds each, not ~2 s of CPU for torch).
    children = in_processes(f"from tests.covering import rows_json; print(rows_json({ARCHS!r}))")
    for seed, there in zip(HASH_SEEDS, children, strict=True):
        assert there == here + "\n", f"PYTHONHASHSEED={seed} gives other rows"


def test_the_harness_sees_hash_order():
    # Negative control: a set of strings iterates in a different order under these seeds.
    outs = in_processes(f"print(list(set({list(grid.AXES['position'])!r})))")
    assert len(set(outs)) > 1, outs


def test_every_row_builds_a_valid_config():
    for v in grid.variants():
        cfg = grid.config(v)
        assert cfg.arch == v["arch"] and cfg.attention.backend == v["backend"]
