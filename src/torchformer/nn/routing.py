"""What each backend needs from the per-forward context, and ``auto``'s choice of backend.

The stack builds one AttnInputs per forward holding the pattern's rules; a *prepare* function
(picked at build time in models/build.py, beside the backend) turns it into what the backend
consumes, once per forward, never per layer: the dense mask/bias for math and sdpa, the block
mask for flex. ``auto`` decides from cheap Python facts only (is the context the plain lower
triangle, does it carry a bias or a query-dependent mask, is soft-capping on, can flex run here),
never from tensor values:

- plain causal or no mask, no soft-cap          -> sdpa (is_causal: its fastest kernel)
- key padding only (encoders), no bias          -> sdpa with a (B, 1, 1, S) mask
- on CPU, a bias or window over aligned positions (self-attention, no padding, documents or
  cache), no soft-cap                           -> offsets (nn/offsets.py: torch's fused CPU
  flash kernel per query chunk, the bias a strided view of one vector per head; forward and
  backward fused, nothing to compile)
- a bias, window, document or causal+padding    -> flex (the dense form would be (B, H, T, S))
- soft-capping                                  -> flex (SDPA cannot soft-cap; math otherwise)
- a cached step (prefill into / decode from the static cache) -> sdpa with the dense pattern
  (or math when soft-capping): built once per forward for all layers, (B, H, T, S_max + 1)
- recorded (analysis.record_attention)          -> math: the recorder swaps the backend itself
Where flex cannot run, auto takes the dense path instead (build warns once, naming why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import Tensor

from .attention import AttnInputs
from .backends import math_attention, sdpa_attention
from .flex import build_blocks, flex_attention
from .offsets import applies, offset_attention, offset_vector
from .patterns import Pattern

Prepare = Callable[[AttnInputs], AttnInputs]


def prepare_dense(ctx: AttnInputs) -> AttnInputs:
    """math / sdpa: the dense mask and bias, unless is_causal already says everything."""
    if ctx.pattern is None or ctx.is_causal:
        return ctx._replace(pattern=None)
    mask, bias = ctx.pattern.dense()
    return ctx._replace(mask=mask, bias=bias)


def prepare_flex(ctx: AttnInputs) -> AttnInputs:
    """flex: the block mask, built once for all layers."""
    if ctx.pattern is None:
        return ctx
    return ctx._replace(pattern=replace(ctx.pattern, blocks=build_blocks(ctx.pattern)))


def auto_preparer(softcap: float | None, flex_ok: bool) -> Prepare:
    """auto's policy (module docstring) for a model with this soft-cap, where flex can or cannot run."""

    def prepare(ctx: AttnInputs) -> AttnInputs:
        p = ctx.pattern
        # Cached steps (slots set) stay dense: a decode step's rows are few, and flex cannot be
        # lowered inside the compiled decode step on CPU (flex.py).
        needs_flex = p is not None and (p.bias is not None or not p.key_only) and not ctx.is_causal
        needs_flex = needs_flex and ctx.slots is None
        if needs_flex and applies(p, softcap):
            return ctx._replace(pattern=replace(p, offsets=offset_vector(p), route=offset_attention))
        if flex_ok and (needs_flex or (softcap is not None and p is not None)):
            return prepare_flex(ctx._replace(pattern=replace(p, route=flex_attention)))
        if p is not None:  # routed first, so the dense forms are built on the Pattern the layers get
            ctx = ctx._replace(pattern=replace(p, route=sdpa_attention if softcap is None else math_attention))
        return prepare_dense(ctx)

    return prepare


def auto_attention(q: Tensor, k: Tensor, v: Tensor, *, pattern: Pattern | None = None, **kwargs) -> Tensor:
    """The backend ``auto`` chose for this forward (sdpa when the context needs nothing more)."""
    route = sdpa_attention if pattern is None or pattern.route is None else pattern.route
    return route(q, k, v, pattern=pattern, **kwargs)
