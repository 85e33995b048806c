"""Bit-reproducible training: the same recipe, seed and thread count give the same bits.

On CPU, some multi-threaded kernels (embedding and index backward among them) sum in an order that
depends on which thread finishes first: two straight runs at 2 threads differed by up to 6.5e-6
after 150 AdamW steps, and bit-equal with ``torch.use_deterministic_algorithms(True)``, at no
measurable cost (15.0-16.0 steps/s either way, issue 10). So ``train.deterministic`` defaults to on
for CPU. On CUDA it also needs cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, which must be
set before the first cuBLAS call) and cuDNN without autotuning; deterministic kernels cost speed
there, so it stays opt-in. Ops without a deterministic CUDA kernel warn (naming the op) instead of
stopping the run, and then the run is not bitwise reproducible.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

import torch

log = logging.getLogger("torchformer.train")
CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's documented setting for reproducible results


def resolve(setting: bool | None, device: torch.device) -> bool:
    """None (the recipe default) means on for CPU, off for CUDA and MPS."""
    return device.type == "cpu" if setting is None else setting


@contextlib.contextmanager
def deterministic(enabled: bool, device: torch.device) -> Iterator[None]:
    """Set torch's determinism for the run, and give the caller's settings back afterwards."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    cuda = device.type == "cuda"
    if enabled and cuda:
        if os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE) not in (CUBLAS_WORKSPACE, ":16:8"):
            warnings.warn(
                f"train.deterministic: CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']!r} is not one "
                f"of cuBLAS's reproducible settings ({CUBLAS_WORKSPACE!r}, ':16:8')",
                stacklevel=3,
            )
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
        log.warning(
            "train.deterministic on CUDA: deterministic kernels and no cuDNN autotuning usually cost a few percent "
            "to ~2x in step time (most in attention backward, scatter/index ops); set train.deterministic=false "
            "for speed"
        )
    torch.use_deterministic_algorithms(enabled, warn_only=cuda)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2], before[3]


def run_facts(enabled: bool, world: int) -> dict:
    """What a checkpoint records about how its bits were made."""
    return {"deterministic": enabled, "threads": torch.get_num_threads(), "world": world}


def warn_if_different(saved: dict, now: dict, path) -> None:
    """A resume with other settings still runs, but is no longer bit-equal to a straight run."""
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
    if changed:
        warnings.warn(
            f"resuming {path} with {', '.join(changed)} (checkpoint -> now): the run continues, but is not "
            "bit-identical to an uninterrupted one (exact resume needs the same train.deterministic, thread count "
            "and world size)",
            stacklevel=3,
        )
