"""Devices, data and tensor parallelism. Under ``torchrun`` (WORLD_SIZE > 1 in the environment)
the process group is initialised from torchrun's variables: NCCL on CUDA, gloo on CPU. Strategy
``ddp`` wraps the objective in DistributedDataParallel; ``fsdp`` shards every block and then the
whole model with FSDP2's ``fully_shard``; ``tp`` splits every block over all ranks (parallel/,
``dist.tp`` = the world size); ``fsdp+tp`` makes a 2-D mesh (data, tp): TP inside groups of
``dist.tp`` ranks, FSDP2 across the groups. Only rank 0 logs and writes checkpoints.

``Runtime.rank`` / ``world`` are the DATA-parallel rank and degree (which rows of a batch a rank
reads, its dropout stream): the ranks of one TP group read the same rows with the same dropout,
since they compute one model together.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

STRATEGIES = ("ddp", "fsdp", "tp", "fsdp+tp")
DEVICES = ("auto", "cpu", "cuda", "mps")


@dataclass(frozen=True)
class Runtime:
    rank: int  # data-parallel rank (module docstring)
    world: int  # data-parallel degree
    device: torch.device
    tp: int = 1  # ranks per tensor-parallel group
    global_rank: int | None = None  # the process's rank in the whole group (None: rank)
    mesh: object = None  # DeviceMesh ("dp", "tp") when tp > 1

    @property
    def is_main(self) -> bool:
        return (self.rank if self.global_rank is None else self.global_rank) == 0


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


def check_layout(strategy: str, tp: int, world: int) -> None:
    """dist.strategy / dist.tp against the launch's world size, before any work."""
    if strategy not in STRATEGIES:
        raise ValueError(f"dist.strategy={strategy!r}: must be one of {list(STRATEGIES)}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"dist.tp={tp!r}: must be an integer >= 1")
    if "tp" not in strategy:
        if tp != 1:
            raise ValueError(f"dist.tp={tp} needs dist.strategy 'tp' or 'fsdp+tp', not {strategy!r}")
        return
    if world == 1:
        raise ValueError(f"dist.strategy={strategy!r} needs several processes: launch with torchrun --nproc_per_node N")
    if strategy == "tp" and tp not in (1, world):
        raise ValueError(f"dist.tp={tp}: with dist.strategy 'tp' every rank is in the TP group (tp = world = {world})")
    if strategy == "fsdp+tp" and (tp < 2 or world % tp or world == tp):
        raise ValueError(f"dist.tp={tp}: 'fsdp+tp' needs 2 <= tp < world={world} with tp dividing the world "
                         "(or use dist.strategy 'tp')")  # fmt: skip


def setup(device: str, strategy: str = "ddp", tp: int = 1) -> Runtime:
    """Initialise the process group when launched by torchrun; otherwise a single process. With a
    tensor-parallel strategy, also the (dp, tp) device mesh and the data-parallel rank/degree."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_layout(strategy, tp, world)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if "tp" not in strategy:
        return Runtime(rank=rank, world=world, device=dev)
    tp = world if strategy == "tp" else tp
    mesh = init_device_mesh(dev.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))  # ranks dp * tp + t
    return Runtime(rank=rank // tp, world=world // tp, device=dev, tp=tp, global_rank=rank, mesh=mesh)


def teardown(failed: type[BaseException] | None = None, *_exc) -> bool:
    """Leave the process group: an ExitStack exit callback (returns False, so an error propagates).
    After a run that ended normally every rank first meets the others at a barrier: rank 0 is still
    writing the plot and the plan's outputs when the others are done, and a rank that tore its gloo
    pairs down and exited while a peer was still connected died in C++ ("terminate called without an
    active exception", SIGABRT, once in CI). After an error there is no barrier: the peers may never
    come, and waiting for them would turn the error into a hang."""
    if dist.is_initialized():
        if failed is None:
            work = dist.barrier(async_op=True)
            work.wait()
            _LAST_BARRIER[:] = [work]
        dist.destroy_process_group()
    return False


# The Work of the last teardown barrier, held until the next teardown or the process's end. Gloo's
# barrier keeps the works still in flight when it was issued (the last checkpoint's all_gather of
# the RNG states); they are freed with it, and freeing their tensors takes the GIL. Had Python
# dropped the barrier first, gloo's worker thread would free it, possibly while the main thread,
# holding the GIL, joins that thread as the process group goes (the DDP model freed at the end of
# the run): a hang at exit, seen twice in the suite (~ProcessGroupGloo in std::thread::join;
# runLoop in ~AsyncBarrierWork -> ~AsyncAllgatherWork -> decref_pyobject, waiting for the GIL).
# Held here, the last reference is Python's, dropped on the main thread.
_LAST_BARRIER: list = []


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def wrap(objective: nn.Module, rt: Runtime, strategy: str) -> nn.Module:
    """The objective as trained: unchanged on one process, DDP or FSDP2 on several; with TP the
    model is split first (parallel/), then FSDP2 shards it over the data dimension of the mesh."""
    if strategy not in STRATEGIES:
        raise ValueError(f"dist.strategy={strategy!r}: must be one of {list(STRATEGIES)}")
    if rt.tp > 1:
        from ..parallel.apply import parallelize  # DTensor's plans: ~0.9 s of imports TP runs alone need

        parallelize(objective.model, rt.mesh["tp"], loss_parallel=True)  # logits stay sharded into the loss
    if rt.world == 1:
        return objective
    if strategy == "ddp":
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(objective, device_ids=ids)
    from torch.distributed.fsdp import fully_shard  # ~1 s of imports: FSDP runs alone pay them

    mesh = rt.mesh["dp"] if rt.mesh is not None else None  # None: FSDP2 over the whole group
    model = objective.model
    for blocks in (getattr(model, name).blocks for name in ("stack", "encoder", "decoder") if hasattr(model, name)):
        for block in blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(objective, mesh=mesh)
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


def sharded(strategy: str, world: int) -> bool:
    """Whether the weights are DTensors (FSDP over several ranks, or any TP): whole state goes
    through torch.distributed.checkpoint's state-dict API. ``world``: the data-parallel degree."""
    return "tp" in strategy or (strategy == "fsdp" and world > 1)


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str, world: int):
    """(weights with tied tensors once, optimizer state dict), whole, for a checkpoint. With FSDP
    this gathers the shards: a collective, so every rank must call it."""
    names = [n for n, _ in model.named_parameters()]  # tied tensors appear once, under their first name
    if not sharded(strategy, world):
        return {n: p.detach().contiguous() for n, p in model.named_parameters()}, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # ~1 s: sharded runs only

    full, optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {n: full[n].contiguous() for n in names if n in full}, optim


def gather_rng(local: dict[str, torch.Tensor], rt: Runtime) -> dict[str, torch.Tensor]:
    """Every rank's RNG states, for rank 0 to save: rank 0's under their own names, rank r's as
    ``name.rank{r}`` (checkpoint.rank_rng reads them back). A collective: every rank calls it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    out = dict(local)
    for name, state in sorted(local.items()):
        on_wire = state.to(rt.device)  # NCCL moves CUDA tensors only; gloo, CPU ones
        parts = [torch.empty_like(on_wire) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, on_wire)
        # One stream per data-parallel rank: the ranks of a TP group (global ranks r*tp .. r*tp+tp-1) share it.
        out.update({f"{name}.rank{r}": parts[r * rt.tp].cpu() for r in range(1, rt.world)})
    return out


def scatter_state(model: nn.Module, optimizer, weights: dict, optim_state: dict, strategy: str, world: int) -> bool:
    """Load whole saved state into a sharded (FSDP, TP) model; False when not sharded (caller loads)."""
    if not sharded(strategy, world):
        return False
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # ~1 s: sharded only

    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True, strict=False))  # fmt: skip
    return True
