"""Attention capture on any backend: ``with record_attention(model) as rec: model(ids)``.

Each chosen Attention module's ``backend`` attribute is swapped for the math reference with
``need_weights=True`` for as long as the block is open, then restored (also on an exception).
The reference computes the same function as SDPA (their parity is tested for every variant),
so the model's outputs are unchanged within float tolerance. Self- and cross-attention calls
are both captured, in call order; a cached decoding step records its (B, H, T, S_max + 1) row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor, nn

from ..nn.attention import Attention
from ..nn.backends import math_attention
from ..nn.latent_attention import LatentAttention


@dataclass(frozen=True)
class Capture:
    """One attention call: the module's name (e.g. ``decoder.blocks.1.cross_attn``), its stack
    (``stack``, ``encoder`` or ``decoder``), block index, kind ``self`` or ``cross``, and the
    post-softmax weights (B, H, T, S), detached."""

    name: str
    stack: str
    layer: int
    kind: str
    weights: Tensor


@dataclass
class Recording:
    captures: list[Capture] = field(default_factory=list)

    @property
    def weights(self) -> dict[str, Tensor]:
        """Module name -> weights (B, H, T, S) of its latest call, in call order."""
        return {c.name: c.weights for c in self.captures}

    def select(self, kind: str | None = None, stack: str | None = None) -> list[Capture]:
        """The latest capture of each module, filtered by kind (self/cross) and stack."""
        latest = {c.name: c for c in self.captures}
        return [c for c in latest.values() if (kind is None or c.kind == kind) and (stack is None or c.stack == stack)]

    def clear(self) -> None:
        self.captures.clear()


def attention_modules(model: nn.Module) -> list[tuple[str, str, int, str, Attention]]:
    """(name, stack, layer, kind, module) for every Attention in ``model``, in module order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, Attention | LatentAttention):  # MLA: recorded on its expanded (uncached) path
            parts = name.split(".")
            i = parts.index("blocks") if "blocks" in parts else None
            stack = parts[i - 1] if i else (parts[0] if parts[0] else "model")
            layer = int(parts[i + 1]) if i is not None else 0
            kind = "cross" if parts[-1] == "cross_attn" else "self"
            found.append((name, stack, layer, kind, module))
    return found


def _chosen(name: str, layer: int, layers: Iterable[int | str] | None) -> bool:
    return layers is None or layer in layers or name in layers


def _recording_backend(rec: Recording, name: str, stack: str, layer: int, kind: str) -> Callable[..., Tensor]:
    def backend(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
        out, weights = math_attention(q, k, v, need_weights=True, **kwargs)
        rec.captures.append(Capture(name, stack, layer, kind, weights.detach()))
        return out

    return backend


@contextmanager
def record_attention(model: nn.Module, layers: Iterable[int | str] | None = None) -> Iterator[Recording]:
    """Capture post-softmax attention weights of every self- and cross-attention call.

    layers: None for all, or block indices (in every stack) and/or module names such as
    ``"decoder.blocks.0.cross_attn"``. Yields a Recording: ``rec.weights`` maps module names to
    (B, H, T, S) weights, ``rec.captures`` lists every call in order. Dropout (training mode)
    is applied to the recorded weights as in the forward: record in eval mode to see the
    distribution itself.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_attention needs an nn.Module, got {type(model).__name__}")
    layers = None if layers is None else list(layers)
    modules = [m for m in attention_modules(model) if _chosen(m[0], m[2], layers)]
    if not modules:
        names = [m[0] for m in attention_modules(model)]
        raise ValueError(f"layers={layers!r} selects no attention module; the model has {names}")
    rec = Recording()
    originals = [(module, module.backend) for *_, module in modules]
    try:
        for name, stack, layer, kind, module in modules:
            module.backend = _recording_backend(rec, name, stack, layer, kind)
        yield rec
    finally:
        for module, backend in originals:
            module.backend = backend
