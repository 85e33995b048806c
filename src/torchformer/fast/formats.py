"""Which fast twin a module gets on this CPU, and the swap: quantized linears become their panel
twins (fast/quant_panels.py, the integer kernels), bf16 ``Linear``s become ``Bf16Linear`` (the bf16
kernel over the module's own weight, fast/bf16.py). The layout belongs to the CPU that runs it, so
it is made at run time and never saved: ``tfm.quantize`` and ``tfm.load`` call ``prepare``; it does nothing where
the kernels are not built (neither AVX-512 nor AVX2, no compiler, ``TORCHFORMER_NATIVE=0``), on other devices, or
for shapes the kernels do not take (K not a multiple of 4 for int8, a group not a multiple of 8 for
int4).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..host_memory import HUGE_PAGE, file_mappings, in_file_mapping, trim
from ..host_memory import release_mapped as release_mapped_pages
from ..nn.linear import Linear
from ..nn.quant import Int4Linear, Int8Linear, QuantLinear
from ..nn.quant_min import Int4MinLinear
from .bf16 import Bf16Linear
from .bf16_joint import Bf16Joint, bf16_groups, bf16_joinable
from .int4_panels import Int4MinPanels, Int4Panels
from .int8_panels import Int8Panels
from .joint import JOINED, OWNERS, JointOwner, PanelJoint, base_class, joinable, twin_class
from .panels import huge_arena
from .quant_panels import PanelLinear, ops_ready

STREAM_CHUNK = 32 << 20  # bytes of a mapped bf16 weight copied into huge pages at a time (stream_mapped_bf16)


def fits(module: nn.Module) -> type[nn.Module] | None:
    """The kernels' twin for ``module``, or None where the kernels cannot run it."""
    if type(module) is Linear and module.weight.dtype == torch.bfloat16 and module.weight.is_cpu:
        return Bf16Linear if ops_ready() else None
    if type(module) in (Int8Linear, Int4Linear, Int4MinLinear):
        return panel_twin(type(module), module.in_features, getattr(module, "group_size", None), module.qweight)
    return None


def panel_twin(scheme: type[QuantLinear], k: int, group_size: int | None, like: Tensor) -> type[PanelLinear] | None:
    """The panel twin of ``scheme`` for K = k inputs, where the kernels run it for a weight on
    ``like``'s device (int8: K and any group a multiple of 4; int4: a group a multiple of 8)."""
    fit = scheme is Int8Linear and k % 4 == 0 and (group_size or k) % 4 == 0
    fit = fit or scheme in (Int4Linear, Int4MinLinear) and group_size % 8 == 0
    twin = {Int8Linear: Int8Panels, Int4Linear: Int4Panels, Int4MinLinear: Int4MinPanels}.get(scheme)
    return twin if fit and like.is_cpu and ops_ready() else None


def quantizer(scheme: type[QuantLinear]):
    """``scheme.from_linear``, or its panel twin's where the kernels run it: a quantizing load
    writes the panels directly, never the portable copy first."""

    def make(lin: nn.Linear, group_size: int | None, on_block=None) -> QuantLinear:
        twin = panel_twin(scheme, lin.in_features, group_size, lin.weight)
        return (twin or scheme).from_linear(lin, group_size, on_block=on_block)

    return make


def prepared(module: nn.Module, release_mapped: bool = False) -> nn.Module:
    """``module``'s kernel twin where ``fits`` finds one, else ``module`` itself. release_mapped (a
    loader's, for a module it has just read from a memory-mapped file): a panel twin's source
    bytes give their pages back (``host_memory.release_mapped``); the twin holds its own copy."""
    twin = fits(module)
    if twin is None:
        return module
    out = twin.of(module)
    if release_mapped and isinstance(out, PanelLinear):
        release_mapped_pages(module.qweight)
    return out


def stream_mapped_bf16(model: nn.Module) -> int:
    """Move the ``Bf16Linear`` weights that lie in a file's mapping (a loader's safetensors) into one
    arena of huge pages (fast/panels.py ``huge_arena``: a batch-1 step reads them whole, and the plain
    read of huge pages is 1.16x that of the mapping's 4 KiB pages here; one arena, so a small model's
    weights of under 2 MiB each get them too), STREAM_CHUNK bytes at a time, each chunk's mapped
    pages given back once copied: the process holds one copy and at most a chunk twice (the 1B
    shape's tied table whole: +440 MiB of peak). The same Parameters, their values unchanged (a tied
    table's embedding reads the copy too); a weight already in memory stays where it is. The
    members of each group ``join`` makes one product of (fast/bf16_joint.py ``bf16_groups``: q/k/v,
    gate/up) come end to end, so that their joint weight is their own bytes, not a copy. Returns
    the bytes moved."""
    candidates = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Bf16Linear)}  # tied: once
    candidates = [w for w in candidates.values() if w.dtype == torch.bfloat16 and w.is_cpu and w.is_contiguous()]
    mappings = file_mappings() if candidates else []  # read once, and only for a model with bf16 twins
    found = [w for w in candidates if in_file_mapping(w, mappings)]
    if found:  # the groups' members first, each group end to end (a later scope finds nothing mapped)
        first = {id(w): i for i, w in enumerate(w for group in bf16_groups(model) for w in group)}
        found.sort(key=lambda w: first.get(id(w), len(first)))  # stable: the rest as they came
    moved = 0
    for inference in (False, True):
        group = [w for w in found if w.is_inference() == inference]
        if group:
            moved += move_into_arena(group, inference, mappings)
    return moved


def move_into_arena(weights: list[Tensor], inference: bool, mappings) -> int:
    """``stream_mapped_bf16``'s move of ``weights``, all of them normal or all inference tensors
    (a model the serving engine loaded under inference_mode): the copies are made as the weights
    were, whatever mode the caller runs in (a decode loop's inference_mode), since an inference
    Parameter given normal data fails in its next op (the tied table's embedding: "Inference
    tensors do not track version counter"). Returns the bytes moved (0: no huge pages here)."""
    with torch.inference_mode(inference), torch.no_grad():
        arena = huge_arena([(tuple(w.shape), w.dtype) for w in weights])
        for w, new in zip(weights, arena or []):
            old = w.data
            row_bytes = old.numel() // max(1, old.shape[0]) * old.element_size()
            step = max(1, STREAM_CHUNK // max(1, row_bytes))  # rows a chunk
            for row in range(0, old.shape[0], step):
                new[row : row + step].copy_(old[row : row + step])
                release_mapped_pages(old[row : row + step], mappings)
            w.data = new
    return sum(w.numel() * w.element_size() for w in weights) if arena else 0


def join(model: nn.Module) -> int:
    """Join each owner's members where they fit, again where a joint went stale, and let an owner
    whose members no longer fit go back to its own products. Returns how many groups are joint."""
    joined = 0
    for module in model.modules():
        base = base_class(module)
        if base is None:
            continue
        names = OWNERS[base][1]
        if isinstance(module, JointOwner) and module.joint is not None and module.joint.current(module):
            joined += 1
            continue
        members = [getattr(module, n, None) for n in names]
        kind = PanelJoint if joinable(members) else Bf16Joint if bf16_joinable(members) else None
        if kind is None:
            if isinstance(module, JointOwner) and module.joint is not None:
                module.joint.unshare()
                module.joint = None
            continue
        module.__class__ = twin_class(base)
        module.joint = kind(module, names)
        joined += 1
        # The members' own buffers, freed as the group moved into its joint one, would stay in
        # glibc's free lists, and the next group's buffer would not fit their holes. Measured, the
        # 1B shape in int8 (resident after load / peak): without joints 1458 / 1496 MB; joined
        # 1701 / 1701; trimmed once at the end 1458 / 1838; trimmed after each group 1458 / 1496.
        trim()
    return joined


def panel_holders(model: nn.Module) -> list[tuple[PanelLinear, PanelJoint | None]]:
    """The modules whose buffers hold ``model``'s panels, each with its joint: every current
    ``PanelJoint``'s fused twin (its members view its buffers), then every panel twin outside one."""
    holders: list[tuple[PanelLinear, PanelJoint | None]] = []
    in_joints: set[int] = set()
    for module in model.modules():
        joint = getattr(module, "joint", None) if isinstance(module, JointOwner) else None
        if isinstance(joint, PanelJoint) and joint.current(module):
            holders.append((joint.fused, joint))
            in_joints.update(id(m) for m in joint.members)
    return holders + [(m, None) for m in model.modules() if isinstance(m, PanelLinear) and id(m) not in in_joints]


def gather_panels(model: nn.Module) -> int:
    """Move the panels and scales the kernels stream whole every decode step that could not have
    huge pages of their own (each under one: fast/panels.py ``stream_zeros``; a small model's, the
    toy shape's every projection but its head) into one arena of huge pages, each its own tensor
    (``huge_arena``): a joint's buffers (its members' views follow them: joint.py
    ``PanelJoint.rebuffer``) and those of the panel twins outside a joint. Their 4 KiB pages were
    ~3,300 TLB entries a toy int4 step walked through every token: with them in huge pages a step
    took 295 against 313 us (one process, the two alternated eight times, medians; the Intel Xeon
    of fast-paths.md). What an earlier call moved stays (``in_arena`` says what it placed; a
    buffer replaced since, by a load into it, moves again). Returns the bytes moved."""
    moves = []  # (holder, its joint, buffer name, the buffer)
    for holder, joint in panel_holders(model):
        placed = holder.__dict__.setdefault("in_arena", {})
        for name in JOINED:
            t = holder._buffers.get(name)
            if t is not None and t.is_cpu and 0 < t.nbytes < HUGE_PAGE and placed.get(name) is not t:
                moves.append((holder, joint, name, t))
    moved = 0
    for inference in (False, True):  # the copies made as the buffers were (a server loads in inference mode)
        group = [move for move in moves if move[3].is_inference() == inference]
        with torch.inference_mode(inference), torch.no_grad():
            arena = huge_arena([(tuple(t.shape), t.dtype) for *_, t in group]) if group else None
        for (holder, joint, name, t), new in zip(group, arena or []):
            new.copy_(t)
            if joint is None:
                holder._buffers[name] = new
            else:
                joint.rebuffer(name, new)
            holder.in_arena[name] = new
            moved += t.nbytes
    return moved


def prepare(model: nn.Module, release_mapped: bool = False) -> int:
    """Swap ``model``'s quantized linears for their panel twins and its bf16 ``Linear``s for
    ``Bf16Linear`` where the kernels run (``prepared``, one module at a time, so a panel copy
    never waits for the others), moves the bf16 weights a loader mapped into huge pages
    (``stream_mapped_bf16``), then joins the panel twins of each attention's q/k/v and each gated
    MLP's gate/up (``join``, again where a load or cast since left a joint stale); returns how
    many were swapped (module docstring). Idempotent; a no-op without the kernels."""
    names = [name for name, m in model.named_modules() if fits(m) is not None]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, prepared(getattr(owner, leaf), release_mapped))
    stream_mapped_bf16(model)  # mapped bf16 weights into huge pages
    join(model)  # q/k/v and gate/up twins as one product each (fast/joint.py, fast/bf16_joint.py)
    gather_panels(model)  # the small ones' panels into huge pages
    return len(names)
