"""Reading the weights of a sharded (DCP) training checkpoint as whole tensors, in one process.

training/sharded_checkpoint.py writes the tensors of a checkpoint folder into ``dcp/`` (one file
per rank and DCP's metadata). Here the model is built from the folder's config.json on the meta
device, DCP fills whole tensors of its shapes (it stitches every rank's shards, whatever the
layout they were saved from), and the model is materialised like any loaded model: ``tfm.load``
and ``torchformer convert`` turn such a folder into a single-file one.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

DCP_DIR = "dcp"


def is_sharded(path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def read_whole(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors of the shapes and dtypes of ``expected`` (name -> a meta tensor), filled from
    the DCP shards in ``path``/dcp; saving.load builds the model and hands its unique state here."""
    import torch.distributed.checkpoint as dcp

    state = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in expected.items()}
    try:
        with warnings.catch_warnings():  # DCP's note that it loads in one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=str(Path(path) / DCP_DIR), no_dist=True)
    except Exception as e:  # DCP names one missing key or shape; say which folder and why
        raise ValueError(f"{path}: the sharded checkpoint does not fit its config.json: {e}") from None
    return state
