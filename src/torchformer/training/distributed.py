"""Devices and data parallelism. Under ``torchrun`` (WORLD_SIZE > 1 in the environment) the
process group is initialised from torchrun's variables: NCCL on CUDA, gloo on CPU. Strategy
``ddp`` wraps the objective in DistributedDataParallel; ``fsdp`` shards every block and then the
whole model with FSDP2's ``fully_shard``. Only rank 0 logs and writes checkpoints.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

STRATEGIES = ("ddp", "fsdp")
DEVICES = ("auto", "cpu", "cuda", "mps")


@dataclass(frozen=True)
class Runtime:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name not in DEVICES:
        raise ValueError(f"train.device={name!r}: must be one of {list(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device='cuda' but torch sees no CUDA device")
        return torch.device("cuda", local_rank)
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("train.device='mps' but the MPS backend is not available")
    return torch.device(name)


def setup(device: str) -> Runtime:
    """Initialise the process group when launched by torchrun; otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Runtime(rank=rank, world=dist.get_world_size() if dist.is_initialized() else 1, device=dev)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def wrap(objective: nn.Module, rt: Runtime, strategy: str) -> nn.Module:
    """The objective as trained: unchanged on one process, DDP or FSDP2 on several."""
    if strategy not in STRATEGIES:
        raise ValueError(f"dist.strategy={strategy!r}: must be one of {list(STRATEGIES)}")
    if rt.world == 1:
        return objective
    if strategy == "ddp":
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(objective, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    model = objective.model
    for blocks in (getattr(model, name).blocks for name in ("stack", "encoder", "decoder") if hasattr(model, name)):
        for block in blocks:
            fully_shard(block)
    fully_shard(objective)
    return objective


def grad_sync(wrapped: nn.Module, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if enabled:
        return contextlib.nullcontext()
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(False)
        return _resync(wrapped)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _resync(wrapped: nn.Module):
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str, world: int):
    """(weights with tied tensors once, optimizer state dict), whole, for a checkpoint. With FSDP
    this gathers the shards: a collective, so every rank must call it."""
    names = [n for n, _ in model.named_parameters()]  # tied tensors appear once, under their first name
    if world == 1 or strategy == "ddp":
        return {n: p.detach().contiguous() for n, p in model.named_parameters()}, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full, optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {n: full[n].contiguous() for n in names if n in full}, optim


def gather_rng(local: dict[str, torch.Tensor], rt: Runtime) -> dict[str, torch.Tensor]:
    """Every rank's RNG states, for rank 0 to save: rank 0's under their own names, rank r's as
    ``name.rank{r}`` (checkpoint.rank_rng reads them back). A collective: every rank calls it."""
    if rt.world == 1:
        return local
    out = dict(local)
    for name, state in sorted(local.items()):
        on_wire = state.to(rt.device)  # NCCL moves CUDA tensors only; gloo, CPU ones
        parts = [torch.empty_like(on_wire) for _ in range(rt.world)]
        dist.all_gather(parts, on_wire)
        out.update({f"{name}.rank{r}": parts[r].cpu() for r in range(1, rt.world)})
    return out


def scatter_state(model: nn.Module, optimizer, weights: dict, optim_state: dict, strategy: str, world: int) -> bool:
    """Load whole saved state into a sharded (FSDP) model; False when not sharded (caller loads)."""
    if world == 1 or strategy == "ddp":
        return False
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True, strict=False))  # fmt: skip
    return True
