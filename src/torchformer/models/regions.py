"""How a stack's blocks run under torch.compile when its layers are big: through one nested compile
region, so identical layers are traced and compiled once (issue 25).

Dynamo reuses a region's traced subgraph for a later call only when every argument flattens to
tensors, numbers and modules and the first trace mutated nothing it did not create (torch 2.13,
the module ``torch._dynamo.variables.invoke_subgraph``, "subgraph_reuse"). A block's arguments break both:
the context holds a ``Pattern`` (rules are closures, not tensors) and the layer's ``LayerCache`` is
an object, and the first layer filled the pattern's memo (``Pattern.additive``) for the others, so
dynamo traced all 16 layers of the 1B shape (structurally equal graphs are only deduplicated after
tracing). Here the stack hands the region the context without its pattern, the pattern "frozen"
into its sizes and the dense tensors a cached step reads (computed before the first layer), and
the cache's k and v; the region's body rebuilds both, so the cache write still lands in the
layer's own tensors (an input mutation of the region, which dynamo and inductor keep in place).
Eager, and where a context cannot be frozen, blocks run as before.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from ..nn.attention import AttnInputs
from ..nn.kv_cache import LayerCache
from ..nn.patterns import Pattern

# Layers of at least this many weights use a region (Llama-3.2-1B's have 61M, the toy's 3M): a
# region adds host work per layer to each compiled call and splits fusions at layer edges; on the
# toy's one-thread int8 step it was slower in about half of the interleaved rounds (up to 1.4 ms
# of ~5), so only layers whose compile and step are both long use it.
REGION_PARAMS = 16_000_000


def run_block(block: nn.Module, x: Tensor, ctx, layer_cache, cross_kv, cross_ctx) -> Tensor:
    return block(x, ctx, layer_cache, cross_kv, cross_ctx)


def run_frozen(block: nn.Module, x: Tensor, ctx: AttnInputs, frozen, k: Tensor | None, v: Tensor | None) -> Tensor:
    """A block over tensors and constants only (what dynamo can reuse): the pattern and the layer
    cache rebuilt from what ``freeze`` and the stack passed."""
    ctx = ctx._replace(pattern=None if frozen is None else thaw(frozen, x.device))
    return block(x, ctx, None if k is None else LayerCache(k, v), None, None)


def _region(fn):
    """``fn`` as a nested compile region holding one entry per distinct layer structure (Gemma's
    kinds, a checkpoint's odd layers), hence roomy. torch 2.11 has regions without
    ``max_reuse_entries`` (its default then holds); torch 2.13 has the argument."""
    if "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters:
        return torch.compiler.nested_compile_region(fn, max_reuse_entries=256)
    return torch.compiler.nested_compile_region(fn)


# Inductor's cpp_wrapper cannot emit a region (NotImplementedError): fast/compiled.py's switch
# turns regions off when the stack is built.
region_block = _region(run_block)
region_frozen = _region(run_frozen)


def freeze(pattern: Pattern | None, dtype: torch.dtype):
    """A cached step's pattern as constants and tensors: ((B, H, T, S, key_only, aligned, reach),
    params, live, dense (mask, bias), additive in ``dtype``), or None for no pattern. Raises
    LookupError for a pattern whose rules a layer may still call (a flex block mask, offsets or a
    route ``auto`` picked): those keep the plain region."""
    if pattern is None:
        return None
    if pattern.route is not None or pattern.blocks is not None or pattern.offsets is not None:
        raise LookupError("pattern rules are read per layer")
    dense = pattern.dense()
    additive = pattern.additive(dtype) if pattern.live is not None else None
    sizes = (pattern.B, pattern.H, pattern.T, pattern.S, pattern.key_only, pattern.aligned, pattern.reach)
    return sizes, pattern.params, pattern.live, dense, additive


def thaw(frozen, device: torch.device) -> Pattern:
    """The Pattern ``freeze`` took apart, without rules: its dense forms are already kept, so the
    backends of a CPU cached step (dense(), additive(), live) read the same tensors."""
    (B, H, T, S, key_only, aligned, reach), params, live, dense, additive = frozen
    pattern = Pattern(None, None, B, H, T, S, device, key_only=key_only, params=params, aligned=aligned,
                      reach=reach, live=live)  # fmt: skip
    object.__setattr__(pattern, "_dense", dense)
    if additive is not None:
        object.__setattr__(pattern, "_additive", additive)
    return pattern


def frozen_contexts(ctxs: tuple[AttnInputs, ...], x: Tensor, cache, cross) -> tuple | None:
    """Each kind's (context without pattern, frozen pattern) for ``region_frozen``, or None where
    the plain region must run: eager, encoder-decoder (cross attention), an accelerator (flex reads
    its rules there) or a cache that is not plain LayerCaches."""
    if not torch.compiler.is_compiling() or cross is not None or not x.is_cpu:
        return None
    if cache is not None and any(type(c) is not LayerCache for c in cache.layers):
        return None
    try:
        return tuple((c._replace(pattern=None, by_kind=()), freeze(c.pattern, x.dtype)) for c in ctxs)
    except LookupError:
        return None
