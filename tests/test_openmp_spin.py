"""torchformer sets libgomp's spin count only where it loads before torch (src/torchformer/_openmp.py)."""

import os
import subprocess
import sys

import pytest

SHOW = "import os; {first}; print(os.environ.get('GOMP_SPINCOUNT'))"


@pytest.mark.parametrize(
    "first, extra, expected",
    [
        ("import torchformer", {}, "3000000"),  # the command's order: before torch, so libgomp reads it
        ("import torch, torchformer", {}, "None"),  # too late to matter: left alone
        ("import torchformer", {"GOMP_SPINCOUNT": "5"}, "5"),  # the user's value wins
        ("import torchformer", {"OMP_WAIT_POLICY": "PASSIVE"}, "None"),  # so does their wait policy
    ],
    ids=["before-torch", "after-torch", "user-count", "user-policy"],
)
def test_the_spin_count_is_a_default_set_only_before_torch_loads(first, extra, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | extra
    out = subprocess.run([sys.executable, "-c", SHOW.format(first=first)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == expected
