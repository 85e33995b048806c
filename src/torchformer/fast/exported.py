"""Decode steps compiled ahead of time by AOTInductor: the step's graph exported once
(``torch.export``), compiled into one shared library, and called from Python with one list of
tensors a token.

Why: a compiled step through dynamo runs Python around its C++ entry every token: dynamo's frame
gathering the weights as graph inputs (~0.8 us each), AOT autograd's wrappers, the host call. On
the toy shape (6 layers, hidden 512, batch 1, 2 threads) that was ~250 of a ~550 us int4 step; the
same graph through AOTInductor took ~300 us (int8 ~610 against ~1000, bf16 ~1200 against ~1550), the
same logits bit for bit. On the 1B shape, where a step is reads more than host code, int4 decoded
1.08x dynamo's (a stack's layers each compiled, not one compile region reused: ~30 s cold).

How: the weights are the package's constants, not inputs. It is compiled without them
(``package_constants_in_so=False``) and bound to the model's own tensors
(``load_constants(..., user_managed=True)``: no copy), and bound again when the model holds other
tensors under the same names (a scope's packed twins are new each generate call). Buffers (the
quantized panels and scales, position tables) and the joint q/k/v buffers (fast/joint.py) are
inputs, with the KV cache, the token ids and positions (``input_slots`` says why). One step per
model, step input shapes and thread count (inductor writes the thread count into its kernels); a
model whose modules change (another type or name, hooks, a joint made or dropped) gets another.
Packages are kept on disk (fast/step_cache.py): a later process loads its step in well under a
second, and never imports dynamo or inductor.

What it does not see: Python values a forward reads are baked into the graph, as dynamo's guards
would have checked them; change a model's config after its first compiled step in a process and
the step keeps the old value (a new process hashes them: fast/step_cache.py).
``TORCHFORMER_AOT_STEP``: ``auto`` (a model on the CPU), ``0`` (never: dynamo's step,
fast/compiled.py) or ``1`` (always).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from . import step_cache
from .compiled import on_cpu
from .joint import JointOwner

log = logging.getLogger(__name__)

VALUES = ("auto", "0", "1")


def setting() -> str:
    """``TORCHFORMER_AOT_STEP``: ``auto`` (unset), ``0`` (never) or ``1`` (always). Anything else is
    refused."""
    value = os.environ.get("TORCHFORMER_AOT_STEP", "auto").strip() or "auto"
    if value not in VALUES:
        raise ValueError(f"TORCHFORMER_AOT_STEP={value!r}: must be auto, 0 or 1")
    return value


def ahead(model: nn.Module) -> bool:
    """Whether ``model``'s decode loops run steps compiled ahead: ``auto`` for a model on the CPU
    (measured there: the toy shape's step ~1.7x dynamo's, the 1B shape's int4 1.08x; an
    accelerator's step keeps dynamo's)."""
    value = setting()
    return value == "1" or (value == "auto" and on_cpu(model))


def input_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, buffer name) of every buffer the step may read, which it takes as inputs: each
    module's buffers (AOTInductor clones the buffers of a graph it compiles, and keeps the clones:
    the 1B shape's int4 panels, buffers, added 760 MiB to the compiling process; parameters it
    reads in place) and each joint buffer (fast/joint.py: plain attributes, which an export would
    lift as unnamed constants)."""
    slots = [(m, n) for m in model.modules() for n, t in m._buffers.items() if t is not None]
    for module in model.modules():
        joint = module.joint if isinstance(module, JointOwner) else None
        if joint is not None:
            slots += [(joint.fused, n) for n, t in joint.fused._buffers.items() if t is not None]
    return slots


@contextlib.contextmanager
def hidden(slots: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """The slots' modules with empty buffer dicts while the block runs (the export then sees no
    buffer; the wrapper puts the inputs in), their own dicts back after, in their order."""
    owners = {id(m): m for m, _ in slots}.values()
    saved = [(m, m._buffers) for m in owners]
    for m, buffers in saved:
        m._buffers = {n: None for n, t in buffers.items() if t is None}  # a None buffer stays one
    try:
        yield
    finally:
        for m, buffers in saved:
            m._buffers = buffers


def named_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer under every name it has (a tied table under both), prefixed as
    the exported wrapper names them (the parameters are the package's constants)."""
    found = dict(model.named_parameters(prefix="model", remove_duplicate=False))
    found.update(model.named_buffers(prefix="model", remove_duplicate=False))
    return found


def structure(model: nn.Module, tensors: dict[str, Tensor], slots: list[tuple[nn.Module, str]]) -> tuple:
    """What a compiled step's graph depends on besides tensor values: each module's name, class,
    hooks and joint, the mode, and each tensor's (``named_tensors``, the ``input_slots``' buffers)
    shape, strides, dtype and device (a library given a tensor of another shape would read past it:
    a model quantized again with another group, say). The step cache's name hashes it too."""
    modules = tuple(
        (
            name,
            type(m),
            m.training,
            bool(m._forward_hooks or m._forward_pre_hooks),
            getattr(m, "joint", None) is not None,
        )
        for name, m in model.named_modules()
    )
    every = [*tensors.items(), *((i, m._buffers[n]) for i, (m, n) in enumerate(slots))]
    return modules, tuple((name, tuple(t.shape), t.stride(), t.dtype, t.device) for name, t in every)


class Wrapper(nn.Module):
    """``fn(model, ids, pos, cache)`` as a module of tensors only: ``forward(ids, pos, *kv, *buffers)``
    with the cache rebuilt around the kv tensors and the buffers put in their slots
    (``input_slots``) while it runs, so the trace reads them as inputs."""

    def __init__(self, model: nn.Module, fn: Callable, cache, slots: list[tuple[nn.Module, str]]) -> None:
        super().__init__()
        self.model, self.fn, self.slots = model, fn, slots
        self.make_cache = type(cache)
        self.layer = type(cache.layers[0])
        self.max_len, self.n = cache.max_len, len(cache.layers)

    def forward(self, ids: Tensor, pos: Tensor, *rest: Tensor) -> Tensor:
        kv, buffers = rest[: 2 * self.n], rest[2 * self.n :]
        saved = [m._buffers.get(n) for m, n in self.slots]
        # Stacks run their layers plainly: a compile region (models/regions.py) is dynamo's way to
        # trace a big layer once; AOTInductor compiles the whole graph, each layer its own code.
        stacks = [m for m in self.model.modules() if getattr(m, "regions", False)]
        for (m, n), t in zip(self.slots, buffers):
            m._buffers[n] = t
        for m in stacks:
            m.regions = False
        try:
            layers = [self.layer(kv[2 * i], kv[2 * i + 1]) for i in range(self.n)]
            return self.fn(self.model, ids, pos, self.make_cache(layers=layers, max_len=self.max_len))
        finally:
            for (m, n), t in zip(self.slots, saved):
                m._buffers[n] = t
            for m in stacks:
                m.regions = True


def cache_tensors(cache) -> list[Tensor]:
    return [t for layer in cache.layers for t in (layer.k, layer.v)]


def package(program: torch.export.ExportedProgram, path: Path | None = None):
    """``program`` compiled by AOTInductor without its constants (into ``path`` when given: the
    step cache, fast/step_cache.py), loaded: the C++ loader (``run(tensors)``,
    ``get_constant_fqns()``, ``load_constants(...)``). Tests swap this for an eager runner of the
    same program (tests/conftest.py ``exported_eager``): inductor's kernels are the dynamo path's,
    tested there."""

    def compile_to(name: str) -> str:
        return torch._inductor.aoti_compile_and_package(
            program, package_path=name, inductor_configs={"aot_inductor.package_constants_in_so": False}
        )

    if path is not None:
        loader = step_cache.load(Path(step_cache.store(compile_to, path)))
    else:
        with tempfile.TemporaryDirectory(prefix="torchformer-step-") as folder:
            loader = step_cache.load(Path(compile_to(os.path.join(folder, "step.pt2"))))  # loaded: the file may go
    if loader is None:  # what was just compiled does not load: the caller falls back to dynamo's step
        raise RuntimeError("the compiled step's library could not be loaded")
    return loader


class ExportedStep:
    """One AOTInductor step for one model's structure, input shapes and thread count: loaded from
    the step cache where it holds one, else exported and compiled (and stored). Holds no
    reference to the model (the registry below is keyed by it), only the tensors it is bound to."""

    def __init__(self, model: nn.Module, fn: Callable, ids: Tensor, pos: Tensor, cache, shape: tuple, slots) -> None:
        self.structure = shape  # structure(model, ...) as the step was made
        inputs = [ids, pos, *cache_tensors(cache), *(m._buffers[n] for m, n in slots)]
        kept = step_cache.folder()
        key = step_cache.fingerprint(model, fn, shape, inputs) if kept else None
        path = kept / f"{key}.pt2" if key else None
        self.loader = step_cache.load(path) if path else None
        self.compiled = self.loader is None
        if self.compiled:
            with warnings.catch_warnings():
                # torch's own pytree code warns of its own deprecated LeafSpec check while exporting
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                with hidden(slots):
                    program = torch.export.export(Wrapper(model, fn, cache, slots), tuple(inputs), strict=False)
                self.loader = package(program, path)
        self.names = list(self.loader.get_constant_fqns())
        self.bound: list[Tensor] = []
        self.buffers: list[Tensor] = []

    def bind(self, tensors: dict[str, Tensor], slots: list[tuple[nn.Module, str]]) -> None:
        """Point the constants at the model's tensors (``named_tensors``; no copy) where they are not
        already, and take its buffers (``input_slots``) as the inputs that follow the cache."""
        missing = [n for n in self.names if n not in tensors]
        if missing:  # a parameter the graph reads is gone: structure() should have seen it
            raise RuntimeError(f"the compiled step's constants {missing[:3]} are no longer the model's")
        now = [tensors[n] for n in self.names]
        if len(now) != len(self.bound) or any(a is not b for a, b in zip(now, self.bound)):
            self.loader.load_constants(dict(zip(self.names, now)), False, True, True)
            self.bound = now  # held: the library reads these tensors' memory, never copies it
        self.buffers = [m._buffers[n] for m, n in slots]

    def __call__(self, ids: Tensor, pos: Tensor, kv: list[Tensor]) -> Tensor:
        return self.loader.run([ids, pos, *kv, *self.buffers])[0]


# model -> {(fn, shapes, threads): ExportedStep}; None where export failed (the dynamo path then)
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
BUILT = [0]  # steps made in this process, compiled or loaded from the step cache (tests count them)
COMPILED = [0]  # of those, the ones exported and compiled here


def step_for(model: nn.Module, fn: Callable, ids: Tensor, pos: Tensor, cache) -> ExportedStep:
    """The compiled step for these inputs, bound to ``model``'s tensors: compiled on first use
    (and again when the model's structure changed), bound again where its tensors changed."""
    kv = cache_tensors(cache)
    key = (fn, tuple(ids.shape), tuple(pos.shape), tuple(tuple(t.shape) for t in kv), torch.get_num_threads())
    steps = _STEPS.setdefault(model, {})
    step = steps.get(key)
    tensors, slots = named_tensors(model), input_slots(model)  # one walk of the model for all below
    shape = structure(model, tensors, slots)
    if step is None or step.structure != shape:
        step = steps[key] = ExportedStep(model, fn, ids, pos, cache, shape, slots)
        BUILT[0] += 1
        COMPILED[0] += step.compiled
    step.bind(tensors, slots)
    return step


def loop(fn: Callable, fallback: Callable[[], Callable]) -> Callable:
    """``fn(model, ids, pos, cache)`` for one decode loop (one model, one cache): each new input shape
    looks its step up once (compiling, binding), later tokens call the library directly. Where
    the export or the compile fails, the loop runs ``fallback()`` (the dynamo step, made only then:
    torch.compile imports dynamo, which a step from the step cache never needs), said once."""
    seen: dict[tuple, ExportedStep | None] = {}
    dynamo: list[Callable] = []

    def call(m: nn.Module, ids: Tensor, pos: Tensor, cache) -> Tensor:
        kv = cache_tensors(cache)
        key = (id(m), ids.shape, pos.shape, kv[0].shape, len(kv))
        step = seen.get(key, False)
        if step is False:
            step = seen[key] = checked(m, fn, ids, pos, cache)
        if step is None:
            if not dynamo:
                dynamo.append(fallback())
            return dynamo[0](m, ids, pos, cache)
        return step(ids, pos, kv)

    return call


_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checked(model: nn.Module, fn: Callable, ids: Tensor, pos: Tensor, cache) -> ExportedStep | None:
    """``step_for``, or None (logged once per model) where the step cannot be exported or compiled."""
    if model in _FAILED:
        return None
    try:
        return step_for(model, fn, ids, pos, cache)
    except Exception as err:  # export's and inductor's errors have no common base
        _FAILED[model] = True
        log.warning(
            "torchformer: the decode step could not be compiled ahead (%s: %s); using torch.compile",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return None
