"""Joint input projections: an attention's q, k and v, a gated MLP's gate and up, as one product.

At one row (a batch-1 decode step) the product of a small quantized matrix is mostly fixed cost,
not reads: the call, x's rounding to int8, the thread team. Measured on the toy shape (hidden 512,
d_ff 1408, int4 group 64, 2 threads, the AVX-512 EPYC, through Python): q, k and v one by one
25.8 us against 7.7 as one (1536, 512) product; gate and up 27.3 against 13.7. So where the
members are panel twins of one format (fast/quant_panels.py: the same class, inputs, group, bits
and scale form, each a whole number of 16-row panels), ``join(model)`` writes their panels and
scales end to end into one buffer per group and points each member's own tensors at its rows of
it: views, no second copy; the members stay the owner's modules, with their names and state dict.
The owner becomes its joint twin (its class swapped in place, as torch.nn.utils.parametrize
does), whose ``project`` / ``gate_up`` runs one product over the joint buffer and splits it per
member (each adds its own bias and casts: ``PanelLinear.finish``). Bit-equal to the members' own
products: the kernel sums each output over its own panel whatever panels sit beside it, and x is
rounded the same way once instead of two or three times. Up to CONTIGUOUS_ROWS rows the model's
output is bit-equal too; past them (a prefill) an fp32 model's parts stay strided views, which an
elementwise kernel downstream may round by an ulp otherwise (GELU).

bf16 members join the same way (fast/bf16_joint.py ``Bf16Joint``). The owner swap itself (``join``)
lies in fast/formats.py with the other swaps.

A member whose tensors were replaced since (a load into it repacks, a dtype cast) no longer views
the joint buffer; a member swapped for another module (an adapter's wrapper) is no longer the one
joined: an eager call checks both, and hooks, and takes the members' own products; ``join`` (run
by ``prepare``, so by every generate's and the serving engine's scope before its compiled step
runs) joins them again or lets the owner go back to its own products, giving each member its own
copy of its rows first (``PanelJoint.unshare``: a compile region refuses inputs that alias one another,
as the members' views would once they run on their own), as ``train()`` does. Grad mode and other
devices take the members' forwards (the reference products, as ``PanelLinear`` does); traced, the
members' identity is guarded, their tensors checked where the step's scope opened.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ..nn.attention import Attention
from ..nn.mlp import GatedMLP
from .panels import LANES, stream_zeros
from .quant_panels import PanelLinear

# owner class -> (the method its twin runs jointly, its members' attribute names)
OWNERS = {Attention: ("project", ("q_proj", "k_proj", "v_proj")), GatedMLP: ("gate_up", ("gate", "up"))}
# The tensors a panel twin keeps one slab of per 16-row panel (dim 0): joined end to end.
JOINED = ("panels", "scale", "super_scale", "minimum", "super_min")
SAME = ("in_features", "group_size", "super_group", "bits", "ways")  # what the members must share
CONTIGUOUS_ROWS = 64  # up to this many rows (decoding, short prompts) the split parts are copied contiguous


class Joint:
    """One owner's members run as one product (``product``, by the subclass: panel twins or bf16
    weights), its output split per member, each finishing its own part (bias, dtype)."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        self.names = names
        self.members = [getattr(owner, n) for n in names]
        self.widths = [m.out_features for m in self.members]

    def mine(self, owner: nn.Module) -> bool:
        """Whether the members are still the owner's modules (not swapped for a wrapper)."""
        return all(getattr(owner, n, None) is m for n, m in zip(self.names, self.members))

    def takes(self, owner: nn.Module, x: Tensor) -> bool:
        """Whether this call runs jointly: the kernels' conditions, the same members and (eager) an
        unchanged group without hooks. Traced, the members' identity becomes dynamo's guards; their
        tensors are checked where the step's scope opened (``join``, just before)."""
        if not self.runs(x) or not self.mine(owner):
            return False
        if torch.compiler.is_compiling():
            return True
        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in self.members)
        return not hooked and self.current(owner)

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """x (..., K) -> each member's output (..., N_i)."""
        out = self.product(x)  # (rows, sum N_i): fp32, or bf16 from a bf16 prefill
        parts = out.split(self.widths, dim=-1)
        if out.shape[0] <= CONTIGUOUS_ROWS:
            # Each part contiguous, as the member's own product is: a strided one can take another
            # kernel downstream (GELU's scalar loop rounds otherwise than its vectorized one). A
            # prefill's parts stay views: copies would add a whole output (the 1B shape's gate/up
            # at 512 rows: 33.5 MB) to the peak, for an ulp of fp32 activations' GELU.
            parts = [p.contiguous() for p in parts]
        return tuple(m.finish(o, x) for m, o in zip(self.members, parts))

    def runs(self, x: Tensor) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def product(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def current(self, owner: nn.Module) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def unshare(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class PanelJoint(Joint):
    """Panel twins' joint buffer: a panel twin over all members' rows (``fused``, a plain attribute,
    not a child module, so the owner's module tree and state dict do not change) and the members'
    views of it."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__(owner, names)
        if any(m.out_features // LANES % m.ways for m in self.members[:-1]):
            # Interleaved panels (quant_panels.py ``interleave``) end to end are the whole's layout
            # only where no group but the last is short: members narrower than that (a toy's q of
            # two panels) join with their panels in order.
            for m in self.members:
                m.interleave(1)
        first = self.members[0]
        fused = type(first).__new__(type(first))
        nn.Module.__init__(fused)
        for key, value in first.__dict__.items():  # its plain attributes: shapes, group, bits
            fused.__dict__.setdefault(key, value)
        fused.out_features = sum(self.widths)
        fused._buffers["bias"] = None  # each member adds its own (finish)
        for name in JOINED:
            parts = [m._buffers.get(name) for m in self.members]
            fused._buffers[name] = None if parts[0] is None else joined(parts)
            start = 0
            for m, part in zip(self.members, parts):
                if part is not None:
                    m._buffers[name] = fused._buffers[name][start : start + part.shape[0]]
                    start += part.shape[0]
        self.fused = fused
        self.views = [tuple(m._buffers.get(n) for n in JOINED) for m in self.members]

    def runs(self, x: Tensor) -> bool:
        return self.members[0].runs(x)

    def product(self, x: Tensor) -> Tensor:
        return self.fused.multiply(x)

    def rebuffer(self, name: str, new: Tensor) -> None:
        """The joint buffer ``name`` replaced by ``new`` (equal values elsewhere: fast/formats.py
        ``gather_panels``), each current member's view of it too; a member no longer viewing the
        joint buffer keeps what it has."""
        self.fused._buffers[name] = new
        i, start, views = JOINED.index(name), 0, []
        for m, view in zip(self.members, self.views):
            rows = view[i].shape[0]
            if m._buffers.get(name) is view[i]:
                m._buffers[name] = new[start : start + rows]
                view = (*view[:i], m._buffers[name], *view[i + 1 :])
            views.append(view)
            start += rows
        self.views = views

    def current(self, owner: nn.Module) -> bool:
        """Whether the members are still the owner's and still view the joint buffer."""
        return self.mine(owner) and all(
            m._buffers.get(n) is t for m, views in zip(self.members, self.views) for n, t in zip(JOINED, views)
        )

    def unshare(self) -> None:
        """Give each member its own copy of what still views the joint buffer. A compile region
        (models/regions.py) refuses inputs that alias one another, as the members' views do, so
        before the members run on their own again in one (a dropped joint, training) they part."""
        for m, views in zip(self.members, self.views):
            for name, view in zip(JOINED, views):
                if view is not None and m._buffers.get(name) is view:
                    m._buffers[name] = view.clone()


def joined(parts: list[Tensor]) -> Tensor:
    """The parts end to end along dim 0 (P_total, ...), in huge pages where that spans one."""
    out = stream_zeros((sum(t.shape[0] for t in parts), *parts[0].shape[1:]), parts[0].dtype)
    return torch.cat(parts, out=out)


def joinable(members: list[nn.Module]) -> bool:
    """Whether the members can share one buffer (module docstring)."""
    first = members[0]
    if not isinstance(first, PanelLinear) or any(type(m) is not type(first) for m in members):
        return False
    if any(getattr(m, a, None) != getattr(first, a, None) for m in members for a in SAME):
        return False
    if any(m.out_features % LANES or m._forward_hooks or m._forward_pre_hooks for m in members):
        return False
    for name in JOINED:
        ts = [m._buffers.get(name) for m in members]
        if any((t is None) != (ts[0] is None) for t in ts):
            return False
        if ts[0] is not None and any(t.dtype != ts[0].dtype or t.shape[1:] != ts[0].shape[1:] for t in ts):
            return False
    return True


class JointOwner:
    """Marks an owner's joint twin class (``twin_class``); ``joint`` is None until joined."""

    joint: Joint | None = None

    def train(self, mode: bool = True):
        """Training mode runs the members' own products (the reference ones): they part first
        (``Joint.unshare``) and the owner goes back to them until ``join`` runs again."""
        if mode and self.joint is not None:
            self.joint.unshare()
            self.joint = None
        return super().train(mode)


@functools.cache
def twin_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with its OWNERS method run by its Joint where it takes the call."""
    method, _ = OWNERS[cls]
    own = getattr(cls, method)

    def joint_method(self, x: Tensor) -> tuple[Tensor, ...]:
        joint = self.joint
        if joint is not None and joint.takes(self, x):
            return joint(x)
        return own(self, x)

    joint_method.__doc__ = own.__doc__
    return type(f"Joint{cls.__name__}", (JointOwner, cls), {method: joint_method})


def base_class(module: nn.Module) -> type[nn.Module] | None:
    """The OWNERS class ``module`` is (or is the joint twin of), else None. Exact classes only: a
    subclass may compute its projections otherwise."""
    cls = type(module)
    if issubclass(cls, JointOwner):
        cls = cls.__mro__[2]  # (twin, JointOwner, base, ...)
    return cls if cls in OWNERS else None
