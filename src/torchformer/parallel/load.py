"""Loading a model split over a TP mesh, each rank reading only its slice of the weights.

The model is built on the meta device (no memory), split by the plan (parallel/apply.py), and
given empty storage of its local shapes; then each weight is read from model.safetensors with
``safe_open(...).get_slice``: a split weight reads only the rows or columns this rank owns (the
chunk DTensor's Shard places here, torch.chunk's split), a whole one (norms) reads all of it. No
rank ever holds a full copy of a split weight.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..models.saving import CONFIG_FILE, WEIGHTS_FILE, build_meta, read_config, unique_state
from .apply import _tied, parallelize


def check_launch(tp: int) -> None:
    """``--tp N`` needs N processes from torchrun: refused before any work otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp {tp!r}: must be an integer >= 1")
    if tp > 1 and world != tp:
        raise ValueError(
            f"--tp {tp} needs {tp} processes, one per shard: launch with torchrun --nproc_per_node {tp} "
            f"(this launch has WORLD_SIZE={world})"
        )


def _chunk(n: int, parts: int, index: int) -> slice:
    """Rows of a dimension of size n that part ``index`` of ``parts`` holds (torch.chunk's split)."""
    size = -(-n // parts)
    start = min(n, index * size)
    return slice(start, min(n, start + size))


def _index(p: torch.Tensor) -> tuple[slice, ...]:
    if not isinstance(p, DTensor):
        return tuple(slice(None) for _ in p.shape)
    index = [slice(None)] * p.ndim
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            mesh = p.device_mesh
            index[placement.dim] = _chunk(p.shape[placement.dim], mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
    return tuple(index)


def load_split(path: str | os.PathLike, mesh: DeviceMesh, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The torchformer model in folder ``path`` split over ``mesh`` (1-D, TP), reading only this
    rank's slices. Every rank of the mesh calls it."""
    from safetensors import safe_open

    cfg, quantization = read_config(path)
    weights = Path(path) / WEIGHTS_FILE
    if quantization is not None or not weights.is_file():
        raise ValueError(
            f"{path}: tensor parallelism loads a float torchformer folder ({CONFIG_FILE} + {WEIGHTS_FILE}, not "
            "quantized); convert other formats first (torchformer convert --from-hf / --from-dcp)"
        )
    model = build_meta(cfg, Path(path) / CONFIG_FILE)
    if dtype is not None:
        model = model.to(dtype)
    ties = _tied(model)
    parallelize(model, mesh)
    model = model.to_empty(device=mesh.device_type)
    with torch.no_grad(), safe_open(str(weights), framework="pt", device="cpu") as f:
        for name, p in unique_state(model).items():
            if name not in set(f.keys()):
                raise ValueError(f"{weights} does not fit its config: no tensor {name!r}")
            local = p.to_local() if isinstance(p, DTensor) else p
            part = f.get_slice(name)[_index(p)]  # only this rank's rows or columns are read
            if tuple(part.shape) != tuple(local.shape):
                raise ValueError(f"{weights}: tensor {name!r} has a shape its config does not give ({p.shape})")
            local.copy_(part)
    for module, name, owner, owner_name in ties:  # to_empty gives each module its own tensor
        setattr(module, name, getattr(owner, owner_name))
    for module in model.modules():
        if hasattr(module, "reset_buffers"):  # position tables, computed not read
            module.reset_buffers(torch.device(mesh.device_type))
    return model.eval()
