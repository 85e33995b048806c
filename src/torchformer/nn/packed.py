"""Few-row products on the CPU through oneDNN, over weights reordered once into its blocked layout.

Decoding a batch multiplies a few rows (one per sequence) by every weight each step. MKL's sgemm
streams a weight poorly for 3..128 rows; oneDNN's inner product over a weight reordered into its
own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing does for
CPU linears) streams it much better. Measured over the decode benchmark's 43 matrices (92 MB
fp32, best of 20 passes, 2 threads; MKL = the faster of F.linear and W @ x^T):

    rows        3     5     8     16    64    128   512
    oneDNN ms   4.9   4.8   5.0   6.2   16.4  30.4  114
    MKL ms      8.8   6.7   8.3   11.1  26.9  48.1  136

and at one thread, 8 rows: 8.5 against 14.4 ms. Over the *plain* weight oneDNN reorders on every
call (7.7 ms at 8 rows): the packed copy is what pays. One or two rows stay with nn/linear.py's
routes (MKL's W @ [x; x]^T and W @ x^T stream ~29 GB/s there, faster than oneDNN's ~18).

A packed copy costs a second copy of each weight and ~0.8 ms per MB to make (75 ms for 92 MB),
so packing is explicit and scoped: ``packed(model)`` packs every Linear for the duration of a
``with`` (generate does it for decode batches of >= MIN_ROWS rows on the CPU; the serving engine
for its lifetime). Correctness never depends on it: the product goes through the custom op
``torchformer::packed_mm``, which finds the weight's packed copy by storage and version and
multiplies plainly when there is none or the weight has changed since (an optimizer step, a
load_state_dict). The op is opaque to torch.compile, so a compiled decode step calls it like any
extern kernel; whether a Linear routes through it is the trace-time constant ``Linear.prepacked``.
Numerics: fp32 products, sums in oneDNN's order (reassociation only).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

MIN_ROWS = 3  # below: nn/linear.py's MKL routes are faster (module docstring)


@dataclass
class _Packed:
    weight: weakref.ref  # the parameter this copy was made from
    version: int | None  # its _version then: an in-place update afterwards makes the copy stale
    shape: torch.Size
    data: Tensor  # oneDNN's blocked layout (an opaque mkldnn tensor)


_COPIES: dict[int, _Packed] = {}  # by the weight's data_ptr


def available(weight: Tensor) -> bool:
    """Whether ``weight`` can be packed: fp32 on the CPU, with oneDNN in this torch build."""
    plain = weight.is_cpu and weight.dtype == torch.float32 and weight.dim() == 2
    return plain and torch.backends.mkldnn.is_available()


def version(weight: Tensor) -> int | None:
    """The weight's version counter; None for an inference tensor (made under inference_mode, as
    the serving engine loads its model), which has none and which nothing outside inference_mode
    can change in place."""
    return None if weight.is_inference() else weight._version


def current(weight: Tensor) -> Tensor | None:
    """The packed copy of ``weight`` if it still matches the weight's storage, shape and version."""
    return _lookup(weight)


def _lookup(weight: Tensor) -> Tensor | None:
    copy = _COPIES.get(weight.data_ptr())
    if copy is None or copy.weight() is None or copy.shape != weight.shape or copy.version != version(weight):
        return None
    return copy.data


@torch.library.custom_op("torchformer::packed_mm", mutates_args=())
def packed_mm(x: Tensor, weight: Tensor) -> Tensor:
    """x (rows, K) @ weight (N, K)^T -> (rows, N), through the weight's packed copy when current."""
    data = current(weight)
    if data is None:
        return x @ weight.t()
    return torch.ops.mkldnn._linear_pointwise(x, data, None, "none", [], "")


@packed_mm.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def pack(model: nn.Module) -> list[nn.Module]:
    """Pack the weight of every torchformer Linear in ``model`` that can be (``available``) and
    mark it ``prepacked``; returns the modules packed (for ``unpack``)."""
    from .linear import Linear

    done = []
    for module in model.modules():
        if isinstance(module, Linear) and not module.prepacked and available(module.weight):
            w = module.weight
            if _lookup(w) is None:
                data = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
                _COPIES[w.data_ptr()] = _Packed(weakref.ref(w), version(w), w.shape, data)
            module.prepacked = True
            done.append(module)
    return done


def unpack(modules: list[nn.Module]) -> None:
    """Drop the packed copies of ``modules`` (from ``pack``) and route them plainly again."""
    for module in modules:
        module.prepacked = False
        _COPIES.pop(module.weight.data_ptr(), None)


@contextlib.contextmanager
def packed(model: nn.Module, rows: int = MIN_ROWS) -> Iterator[None]:
    """Pack ``model``'s Linears while the block runs, when its products will have >= MIN_ROWS
    rows (``rows``: the decode batch); a no-op otherwise, or for weights that cannot be packed."""
    modules = pack(model) if rows >= MIN_ROWS else []
    try:
        yield
    finally:
        unpack(modules)
