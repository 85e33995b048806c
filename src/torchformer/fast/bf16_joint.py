"""Joint bf16 projections: an attention's q, k and v, a gated MLP's gate and up, as one product over
their bf16 weights end to end (fast/joint.py says how members join and run).

bf16 members (fast/bf16.py ``Bf16Linear``: one dtype, one K) join the same way (``Bf16Joint``):
their weights end to end are one (sum N_i, K) matrix, and one product over it gives each member's
outputs bit for bit (the kernel sums each output over its own weight row). A loaded model's
weights already lie end to end (fast/formats.py ``stream_mapped_bf16`` lays each group's members
so), and the joint weight is a window onto their bytes; elsewhere ``join`` copies the members into
one block first, each member's Parameter then a window onto its rows (the same Parameter, its
values unchanged). Each window has a storage of its own (a compile region refuses inputs sharing
one), so the members can run on their own at any time: prefills of bf16 activations take oneDNN's
product per member (fast/bf16.py ``units_take``), and training needs no parting. Measured (the toy shape's
43 bf16 products of a batch-1 step against 25 joint ones, one row, 2 threads, in huge pages,
through Python, best of 30 in four rounds): 0.91-1.09 ms against 0.86-0.96.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..host_memory import release_mapped
from .bf16 import Bf16Linear, bf16_product, kernels_take
from .joint import OWNERS, Joint, base_class
from .panels import storage_window, stream_zeros


class Bf16Joint(Joint):
    """bf16 members' weights as one (sum N_i, K) matrix (module docstring): ``fused.weight``, a
    window onto the members' own bytes (``fused`` a plain module holding it as a buffer, which the
    compiled step takes as an input: fast/exported.py ``input_slots``)."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__(owner, names)
        weights = [m.weight for m in self.members]
        if not end_to_end(weights):
            lay_end_to_end(weights)
        self.fused = nn.Module()
        shape = (sum(self.widths), weights[0].shape[1])
        self.fused._buffers["weight"] = storage_window(weights[0], shape, keep=[w.data for w in weights])
        self.held = [(w, w.data_ptr(), tuple(w.shape)) for w in weights]

    def runs(self, x: Tensor) -> bool:
        return all(m.runs(x) for m in self.members) and kernels_take(x)

    def product(self, x: Tensor) -> Tensor:
        return bf16_product(x, self.fused.weight)

    def current(self, owner: nn.Module) -> bool:
        """Whether the members are still the owner's, with the same Parameters over the same bytes
        (a cast or a load that assigns gives a Parameter other data; an in-place load writes
        through to the joint weight, which stays current)."""
        return self.mine(owner) and all(
            m._parameters.get("weight") is w and w.data_ptr() == ptr and w.dtype == torch.bfloat16 and w.shape == shape
            for m, (w, ptr, shape) in zip(self.members, self.held)
        )

    def unshare(self) -> None:
        """Nothing to part: each member's window has a storage of its own."""


def end_to_end(weights: list[Tensor]) -> bool:
    """Whether ``weights`` (contiguous, one dtype and K) lie one right after another in memory."""
    return all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(weights, weights[1:]))


def lay_end_to_end(weights: list[Tensor]) -> None:
    """Copy the (bf16, one K) ``weights`` into one block, in huge pages where it spans one, each
    Parameter then a window onto its rows (the same Parameter and values); made as the weights were
    (normal or inference tensors, as fast/formats.py ``move_into_arena`` says why). Pages a file's
    mapping held are given back."""
    with torch.inference_mode(weights[0].is_inference()), torch.no_grad():
        block = stream_zeros((sum(w.shape[0] for w in weights), weights[0].shape[1]), weights[0].dtype)
        start = 0
        for w in weights:
            old = w.data
            rows = block[start : start + w.shape[0]]
            rows.copy_(old)
            w.data = storage_window(rows, tuple(rows.shape), keep=[block])
            release_mapped(old)
            start += w.shape[0]


def bf16_joinable(members: list[nn.Module]) -> bool:
    """Whether bf16 members can run as one product: each an exact ``Bf16Linear`` (a subclass may
    compute otherwise) with its own contiguous bf16 CPU weight of one K, all normal or all
    inference tensors, no hooks."""
    if not members or any(type(m) is not Bf16Linear or m._forward_hooks or m._forward_pre_hooks for m in members):
        return False
    weights = [m.weight for m in members]
    if len({id(w) for w in weights}) < len(weights):
        return False
    first = weights[0]
    return all(
        w.dtype == torch.bfloat16 and w.is_cpu and w.dim() == 2 and w.is_contiguous() and w.shape[1] == first.shape[1]
        and w.is_inference() == first.is_inference()
        for w in weights
    )  # fmt: skip


def bf16_groups(model: nn.Module) -> list[list[Tensor]]:
    """The weights of each owner's bf16 members that ``join`` would make one product of."""
    groups = []
    for module in model.modules():
        base = base_class(module)
        if base is not None:
            members = [getattr(module, n, None) for n in OWNERS[base][1]]
            if bf16_joinable(members):
                groups.append([m.weight for m in members])
    return groups
