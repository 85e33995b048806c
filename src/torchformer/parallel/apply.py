"""Apply a TP plan to a built model in place: the weights become DTensors sharded over a
``DeviceMesh``, the modules and state-dict keys stay as they are.

The one thing a forward reads that the split changes is the head count: after the q/k/v
projections are split by columns, each rank's projection yields H/tp heads, and the attention
reshapes by ``Attention.n_heads`` / ``n_kv_heads``. Those two fields are set to the local counts
here, once, so the forward has no branch for the parallel case; the static cache is allocated with
the local K/V head count through the model's ``kv_shards`` (models/decoder.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from ..nn.attention import Attention
from .plan import TPPlan, tp_plan


def tp_mesh(device_type: str, tp: int) -> DeviceMesh:
    """A 1-D mesh over all ``tp`` ranks of the process group (inference, or training with tp only)."""
    return init_device_mesh(device_type, (tp,), mesh_dim_names=("tp",))


def _tied(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, owner, name) for every parameter that is another module's parameter too."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in first and first[id(param)][0] is not module:
                ties.append((module, name, *first[id(param)]))
            first.setdefault(id(param), (module, name))
    return ties


def parallelize(model: nn.Module, mesh: DeviceMesh, *, loss_parallel: bool = False) -> TPPlan:
    """Shard ``model`` (built from ``model.config``) over the 1-D ``mesh`` by ``tp_plan``, in place;
    returns the plan. Every rank must hold the same weights before the call (the same seed or the
    same checkpoint): each keeps its slice of them.

    loss_parallel (training): the logits stay sharded into the loss, and every weight the plan
    leaves whole (norms, positions) becomes a replicated DTensor on the same mesh, so that gradient
    clipping and FSDP2 see one kind of parameter (torch's clip_grad_norm_ refuses a mix)."""
    plan = tp_plan(model.config, mesh.size(), loss_parallel=loss_parallel)
    if plan.tp == 1:
        return plan
    ties = _tied(model)  # parallelize_module replaces parameters one module at a time
    parallelize_module(model, mesh, plan.styles)
    for module, name, owner, owner_name in ties:
        # A tied head and table are both split by vocabulary rows (Shard(0)): one DTensor serves both.
        setattr(module, name, getattr(owner, owner_name))
    for module in model.modules():
        if isinstance(module, Attention):
            module.n_heads, module.n_kv_heads = plan.heads, plan.kv_heads  # this rank's heads (module docstring)
    model.kv_shards = plan.tp
    if loss_parallel:
        _replicate_rest(model, mesh)
    return plan


def _replicate_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every module owning plain parameters gets them as replicated DTensors; its tensor inputs are
    wrapped as replicated (each rank holds the same activations there) and its outputs unwrapped,
    so the modules around it see plain tensors as before."""

    def partition(name, module, mesh):
        for key, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                module.register_parameter(key, nn.Parameter(distribute_tensor(p, mesh, [Replicate()]), p.requires_grad))

    def inputs(module, args, mesh):
        return tuple(DTensor.from_local(a, mesh, [Replicate()]) if _plain(a) else a for a in args)

    def outputs(module, out, mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, mesh, partition, inputs, outputs)


def _plain(x) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def local_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole model) over parameters, tied ones once."""
    seen: set[int] = set()
    local = whole = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = p.to_local() if isinstance(p, DTensor) else p
        local += t.numel() * t.element_size()
        whole += p.numel() * p.element_size()
    return local, whole


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole (a collective: every rank calls it), tied ones once, under their first name."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
    return out
