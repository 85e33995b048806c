"""Few-row products on the CPU over a packed copy of each weight: a native panel kernel, or oneDNN.

Decoding a batch multiplies a few rows (one per sequence) by every weight each step. MKL's sgemm
streams a weight poorly for 3..64 rows. Two packed forms do better, measured over the decode
benchmark's 43 matrices (92 MB fp32, best of 8-20 passes; MKL = F.linear):

    1 thread, rows     1     3     8     12    16    32    64
    panel kernel ms    4.5   5.7   6.9   9.8   11.7  19.9  35.5
    oneDNN ms          8.4   7.7   10.4  11.7  11.2  20.9  35.4
    MKL ms             11.1  21.0  16.8  19.4  19.5  32.4  41.8

- The panel kernel (fast/csrc/kernels.cpp through fast/native.py, AVX-512, built once per machine by
  torch's extension loader and cached): the weight in panels of 16 output rows, each (K, 16), so a panel is one
  sequential stream and each input value is one broadcast FMA into 16 outputs, no horizontal sums.
- oneDNN's inner product over the weight reordered into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing does for CPU linears),
  where the kernel cannot run (no AVX-512, no compiler, ``TORCHFORMER_NATIVE=0``). Over the plain
  weight oneDNN reorders on every call (7.7 ms at 8 rows): the packed copy is what pays.

One or two rows stay with nn/linear.py's routes (MKL's W @ [x; x]^T, inductor's row sums).
A packed copy costs a second copy of each weight and tens of ms per 100 MB to make, so packing is
explicit and scoped: ``packed(model)`` packs every Linear for the duration of a ``with``
(generate does it for decode batches of >= MIN_ROWS rows on the CPU, and for speculative verify
chunks of k + 1 >= MIN_ROWS rows; the serving engine for its lifetime). Correctness never
depends on it: the product goes through a custom op (``torchformer::panel_linear`` or
``torchformer::packed_mm``), which finds the weight's packed copy by storage and version and
multiplies plainly when there is none or the weight has changed since (an optimizer step, a
load_state_dict). The op is opaque to torch.compile, so a compiled decode step calls it like any
extern kernel; whether and how a Linear routes through it is the trace-time constant
``Linear.prepacked`` (the product function: ``panel_product`` or ``onednn_product``).
Numerics: fp32 products, sums in another order (reassociation only).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..fast.native import kernels

MIN_ROWS = 3  # below: nn/linear.py's MKL routes are faster (module docstring)
LANES = 16  # outputs per panel: one AVX-512 register of fp32


def panels(rows: Tensor) -> Tensor:
    """rows (N, K, ...) -> (ceil(N / 16), K, 16, ...): rows 16p..16p+15 side by side per input
    index in panel p, zero-padded past N (fp32 weights here; the int8 / int4 bytes and their
    scales in fast/formats.py)."""
    N = rows.shape[0]
    padded = rows.new_zeros((-(-N // LANES) * LANES, *rows.shape[1:]))
    padded[:N] = rows
    return padded.view(-1, LANES, *rows.shape[1:]).transpose(1, 2).contiguous()


@dataclass
class _Packed:
    weight: weakref.ref  # the parameter this copy was made from
    version: int | None  # its _version then: an in-place update afterwards makes the copy stale
    shape: torch.Size
    data: Tensor  # panels (P, K, 16), or oneDNN's blocked layout (an opaque mkldnn tensor)
    panel: bool


_COPIES: dict[int, _Packed] = {}  # by the weight's data_ptr


def available(weight: Tensor) -> bool:
    """Whether ``weight`` can be packed: fp32 on the CPU, with the panel kernel or oneDNN here."""
    plain = weight.is_cpu and weight.dtype == torch.float32 and weight.dim() == 2
    return plain and (torch.backends.mkldnn.is_available() or kernels() is not None)


def version(weight: Tensor) -> int | None:
    """The weight's version counter; None for an inference tensor (made under inference_mode, as
    the serving engine loads its model), which has none and which nothing outside inference_mode
    can change in place."""
    return None if weight.is_inference() else weight._version


def current(weight: Tensor) -> _Packed | None:
    """The packed copy of ``weight`` if it still matches the weight's storage, shape and version:
    what the products read (``pack`` calls ``_lookup`` itself, so a spy on this sees products only)."""
    return _lookup(weight)


def _lookup(weight: Tensor) -> _Packed | None:
    copy = _COPIES.get(weight.data_ptr())
    if copy is None or copy.weight() is None or copy.shape != weight.shape or copy.version != version(weight):
        return None
    return copy


def panel_product(x: Tensor, weight: Tensor) -> Tensor:
    """x (rows, K) @ weight (N, K)^T through the weight's panels, found by the extension itself
    (no Python per product: the op ``torchformer::panel_linear``); plain when they are not current."""
    return torch.ops.torchformer.panel_linear(x, weight)


def onednn_product(x: Tensor, weight: Tensor) -> Tensor:
    """x (rows, K) @ weight (N, K)^T through the weight's oneDNN copy (the op below); compiled, up to
    COMPILED_ROWS rows take inductor's row sums instead, which are faster than oneDNN there."""
    from .linear import COMPILED_ROWS, rowwise_product

    if torch.compiler.is_compiling() and x.shape[0] <= COMPILED_ROWS:
        return rowwise_product(x, weight)
    return torch.ops.torchformer.packed_mm(x, weight)


@torch.library.custom_op("torchformer::packed_mm", mutates_args=())
def packed_mm(x: Tensor, weight: Tensor) -> Tensor:
    """x (rows, K) @ weight (N, K)^T -> (rows, N), through the weight's oneDNN copy when current."""
    copy = current(weight)
    if copy is None or copy.panel:  # panels are the extension's (panel_product); none: plain
        return x @ weight.t()
    return torch.ops.mkldnn._linear_pointwise(x, copy.data, None, "none", [], "")


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
                panel = kernels() is not None
                data = panels(w.detach()) if panel else torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
                _COPIES[w.data_ptr()] = _Packed(weakref.ref(w), version(w), w.shape, data, panel)
                if panel:
                    kernels().register_panels(w.detach(), data)
            module.prepacked = panel_product if _lookup(w).panel else onednn_product
            done.append(module)
    return done


def unpack(modules: list[nn.Module]) -> None:
    """Drop the packed copies of ``modules`` (from ``pack``) and route them plainly again."""
    for module in modules:
        # Back to the class attribute, not an instance one set to None: a compiled graph traced
        # before the first pack guards on the module's __dict__ and would fail (recompile).
        module.__dict__.pop("prepacked", None)
        copy = _COPIES.pop(module.weight.data_ptr(), None)
        if copy is not None and copy.panel:
            kernels().unregister_panels(module.weight)
