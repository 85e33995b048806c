"""The kernels' copies for a CPU without AVX512-VNNI (csrc/quantized.cpp), run in one child process
with TORCHFORMER_VNNI=0 (read when the ops load). Each kernel test file names a function of no
arguments that seeds torch, builds its inputs and modules and returns (inputs, products); the child
runs them all, once, and the test compares them bit for bit with what the function returns here
(the VNNI copies where the CPU has them): integer sums are exact either way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

# "module:function" of every test file's products (one child serves them all: ~4 CPU-s of imports)
PRODUCTS = (
    "tests.fast.test_formats:products",
    "tests.fast.test_quant_min:products",
    "tests.fast.test_quant_scales:products",
    "tests.fast.test_quant_two_level:products",
    "tests.fast.test_quant_low_bits:products",
)

CHILD = """
import importlib, sys, torch
from torchformer.fast import formats
assert formats.ops_ready() and not torch.ops.torchformer.has_vnni(), "TORCHFORMER_VNNI=0 did not take"
out = {}
for name in sys.argv[2:]:
    module, function = name.split(":")
    with torch.no_grad():
        out[name] = getattr(importlib.import_module(module), function)()
torch.save(out, sys.argv[1])
"""


def run_without_vnni(folder: Path) -> dict:
    """name -> (inputs, products) of every PRODUCTS function, computed in a no-VNNI child."""
    path = folder / "no_vnni.pt"
    env = {**os.environ, "TORCHFORMER_VNNI": "0"}
    subprocess.run([sys.executable, "-c", CHILD, str(path), *PRODUCTS], check=True, env=env, timeout=300)
    return torch.load(path)


def assert_same_bits(name: str, theirs: dict) -> None:
    """``name``'s function here equals what the no-VNNI child returned: inputs (so both sides
    computed from the same numbers) and products, bit for bit."""
    module, function = name.split(":")
    with torch.no_grad():
        xs, outs = getattr(sys.modules[module], function)()
    their_xs, their_outs = theirs[name]
    assert len(outs) == len(their_outs) > 0
    assert all(torch.equal(a, b) for a, b in zip(xs, their_xs)), "the inputs differ: not seeded alike"
    for i, (ours, plain) in enumerate(zip(outs, their_outs)):
        assert torch.equal(ours, plain), f"{name}: product {i} differs without VNNI"
