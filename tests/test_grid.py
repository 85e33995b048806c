"""The covering array in tests/grid.py really covers every pair, and every row builds."""

import itertools

import pytest

from . import grid


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


def test_generation_is_deterministic():
    assert grid.pairwise(grid.AXES) == grid.pairwise(grid.AXES)


def test_every_row_builds_a_valid_config():
    for v in grid.variants():
        cfg = grid.config(v)
        assert cfg.arch == v["arch"] and cfg.attention.backend == v["backend"]
