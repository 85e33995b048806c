"""Few-row products on the CPU over a packed copy of each weight: a native panel kernel, or oneDNN.

Decoding a batch multiplies a few rows (one per sequence) by every weight each step. MKL's sgemm
streams a weight poorly for 3..64 rows. Two packed forms do better, measured over the decode
benchmark's 43 matrices (92 MB fp32, best of 8-20 passes; MKL = F.linear):

    1 thread, rows     1     3     8     12    16    32    64
    panel kernel ms    4.5   5.7   6.9   9.8   11.7  19.9  35.5
    oneDNN ms          8.4   7.7   10.4  11.7  11.2  20.9  35.4
    MKL ms             11.1  21.0  16.8  19.4  19.5  32.4  41.8

- The panel kernel (csrc/kernels.cpp through native.py, AVX-512 or AVX2, built once per machine by
  torch's extension loader and cached): the weight in panels of 16 output rows, each (K, 16), so a panel is one
  sequential stream and each input value is one broadcast FMA into 16 outputs, no horizontal sums.
- oneDNN's inner product over the weight reordered into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing does for CPU linears),
  where the kernel cannot run (neither AVX-512 nor AVX2, no compiler, ``TORCHFORMER_NATIVE=0``). Over the plain
  weight oneDNN reorders on every call (7.7 ms at 8 rows): the packed copy is what pays.

One or two rows stay with nn/linear.py's routes (MKL's W @ [x; x]^T, inductor's row sums).
A packed copy costs a second copy of each weight and tens of ms per 100 MB to make, so packing is
explicit and scoped: ``pack(model)`` swaps every fp32 ``Linear`` for its ``PackedLinear`` twin
(the same Parameters, plus the copy) and ``unpack`` swaps the originals back, as ``tfm.quantize``
swaps modules; fast/scope.py's ``packed(model, rows)`` does both around a block (generate for
decode batches of >= MIN_ROWS rows on the CPU and speculative verify chunks of k + 1 >= MIN_ROWS
rows; the serving engine for its lifetime). nn/ knows nothing of it. Correctness never depends
on it: the twin multiplies plainly once the weight has changed since it was packed (an
optimizer step, a load_state_dict's copy_): the op ``torchformer::panel_linear`` compares the
weight's version with the one packed, and so does the oneDNN route. The op is opaque to
torch.compile, so a compiled decode step calls it like any extern kernel. Compiled, the oneDNN
copy (an opaque mkldnn tensor a graph cannot take) is left out: those products are
``Linear``'s. Numerics: fp32 products, sums in another order (reassociation only).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch import Tensor, nn

from ..host_memory import anonymous_mappings, huge_page_memory, release_consumed
from ..nn.linear import Linear
from .native import kernels

MIN_ROWS = 3  # below: nn/linear.py's MKL routes are faster (module docstring)
RELAYOUT_CHUNK = 4 << 20  # bytes to_stream / from_stream copy at a time
LANES = 16  # outputs per panel: one AVX-512 register of fp32 (two AVX2 ones: csrc/wide.h)


def panels(rows: Tensor) -> Tensor:
    """rows (N, K, ...) -> (ceil(N / 16), K, 16, ...): rows 16p..16p+15 side by side per input
    index in panel p, zero-padded past N (fp32 weights here; the int8 / int4 bytes and their
    scales in fast/quant_panels.py)."""
    N = rows.shape[0]
    padded = rows.new_zeros((-(-N // LANES) * LANES, *rows.shape[1:]))
    padded[:N] = rows
    return padded.view(-1, LANES, *rows.shape[1:]).transpose(1, 2).contiguous()


def to_stream(parts: list[Tensor], groups: int, ways: int, consume: bool = False) -> Tensor:
    """parts, each (P, L_i, ...) with its panels one after another and L_i a multiple of ``groups``
    (the panels' lines, the scales' rows of 16: dim 1 runs over the inputs) -> one (P, bytes)
    uint8 stream, each group of ``ways`` panels (the last one's w what is left) in its w rows:
    weight group by weight group, each part's rows of it line by line (row r of panel j at
    (r * w + j) * its row's bytes), the parts one after another (csrc/quantized.cpp's layout). Made
    a few groups at a time, RELAYOUT_CHUNK bytes of the parts a copy; in huge pages where they fit.
    consume: the parts are the caller's alone, dropped after; the pages of each chunk copied are
    given back (``release_consumed``), so a matrix is never held twice whole (a quantizing load's
    peak: tests/fast/test_quantizing_load.py)."""
    P = parts[0].shape[0]
    rows = [as_rows(t, groups) for t in parts]  # (P, groups, rows a group, row bytes)
    out = stream_zeros((P, sum(r[0].numel() for r in rows)), torch.uint8)
    mappings = anonymous_mappings() if consume else []
    for start, stop, w in group_spans(P, ways, sum(r[0].numel() for r in rows)):
        n = (stop - start) // w
        laid = [r[start:stop].view(n, w, *r.shape[1:]).permute(0, 2, 3, 1, 4).reshape(n, groups, -1) for r in rows]
        out[start:stop].view(n, groups, -1).copy_(torch.cat(laid, dim=-1))
        for r in rows if consume else ():
            release_consumed(r[start:stop], mappings)
    return out


def from_stream(
    stream: Tensor, like: list[tuple[tuple[int, ...], torch.dtype]], groups: int, ways: int
) -> list[Tensor]:
    """``to_stream``'s inverse: the parts (P, *shape) of (shape, dtype) in ``like``, panels in order."""
    P = stream.shape[0]
    parts = [stream_zeros((P, *shape), dtype) for shape, dtype in like]
    rows = [as_rows(t, groups) for t in parts]
    widths = [r[0, 0].numel() for r in rows]  # a part's bytes of one weight group of one panel
    for start, stop, w in group_spans(P, ways, stream.shape[1]):
        n = (stop - start) // w
        laid = stream[start:stop].view(n, groups, -1).split([w * b for b in widths], dim=-1)
        for r, got in zip(rows, laid):
            shape = (n, groups, r.shape[2], w, r.shape[3])
            r[start:stop].view(n, w, *r.shape[1:]).copy_(got.reshape(shape).permute(0, 3, 1, 2, 4))
    return parts


def as_rows(t: Tensor, groups: int) -> Tensor:
    """t (P, L, ...) as bytes (P, groups, L / groups, a row's bytes): a view."""
    P, L = t.shape[0], t.shape[1]
    return t.reshape(P, L, -1).view(torch.uint8).view(P, groups, L // groups, -1)


def group_spans(P: int, ways: int, panel_bytes: int):
    """(start, stop, w): the P panels' groups of ``ways`` as a few whole groups at a time (about
    RELAYOUT_CHUNK bytes), the last group (of w = what is left) alone."""
    full = P // ways * ways
    step = max(1, RELAYOUT_CHUNK // (ways * panel_bytes)) * ways
    for start in range(0, full, step):
        yield start, min(full, start + step), ways
    if full < P:
        yield full, P, P - full


def stream_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """torch.zeros for a buffer the kernels read whole every decode step (the quantized panels and
    their scales): in transparent huge pages where it spans one (``huge_zeros``), else torch's own
    memory."""
    out = huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if out is None else out


def streamed(t: Tensor) -> Tensor:
    """``t`` copied into huge pages where it spans one (a buffer made elsewhere: compacted or
    two-level scales), else ``t`` itself."""
    out = huge_zeros(tuple(t.shape), t.dtype)
    return t if out is None else out.copy_(t)


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    """Zeros over ``host_memory.huge_page_memory`` (a batch-1 step's plain read of them is 1.16x that
    of 4 KiB pages here), the tensor keeping its mapping alive; None where there are none to have
    (less than a huge page, not Linux, ``TORCHFORMER_HUGE_PAGES=0``)."""
    found = huge_arena([(shape, dtype)])
    return None if found is None else found[0]


def huge_arena(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor] | None:
    """Zero tensors of these (shape, dtype)s side by side in one ``huge_page_memory`` mapping (each
    at a multiple of 64 bytes), so tensors of under 2 MiB get huge pages too; each tensor has a
    storage of its own (a compile region refuses inputs sharing one: models/regions.py) and keeps
    the mapping alive. None where there are no huge pages to have."""
    sizes = [-(-math.prod(shape) * dtype.itemsize // 64) * 64 for shape, dtype in specs]
    got = huge_page_memory(sum(sizes))
    if got is None:
        return None
    mapping, start = got
    out = []
    for (shape, dtype), size in zip(specs, sizes):
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape))
        start += size
    return out


def storage_window(t: Tensor, shape: tuple[int, ...], keep: list[Tensor]) -> Tensor:
    """A tensor of ``shape`` and ``t``'s dtype over the bytes from ``t``'s first element on, with a
    storage of its own (as ``huge_arena``'s tensors have: a compile region refuses inputs sharing
    one, and members of a joint run in one on their own: fast/joint.py). It holds ``keep``, the
    tensors whose memory those bytes are, for as long as it lives."""
    nbytes = math.prod(shape) * t.element_size()
    window = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    window.keep = keep  # torch.frombuffer holds the window, the window the memory's owners
    return torch.frombuffer(window, dtype=torch.uint8).view(t.dtype).view(shape)


def version(weight: Tensor) -> int:
    """The weight's version counter; -1 for an inference tensor (made under inference_mode, as the
    serving engine loads its model), which has none and which nothing outside inference_mode can
    change in place."""
    return -1 if weight.is_inference() else weight._version


def available(weight: Tensor) -> bool:
    """Whether ``weight`` can be packed: fp32 on the CPU, with the panel kernel or oneDNN here."""
    plain = weight.is_cpu and weight.dtype == torch.float32 and weight.dim() == 2
    return plain and (torch.backends.mkldnn.is_available() or kernels() is not None)


class PackedLinear(Linear):
    """A ``Linear`` (or subclass: ``twin_class``) with a packed copy of its weight: its products of
    MIN_ROWS or more rows that autograd does not track go through the copy (module docstring)."""

    panel = True  # the copy's form: panels (the kernel's) or oneDNN's blocked layout
    packed_version = -1  # the weight's version when it was packed

    @classmethod
    def of(cls, source: Linear) -> PackedLinear:
        """The twin of ``source``: the same Parameters (its parameter dict itself, so nothing can
        diverge), its own buffers with the copy added."""
        cls = twin_class(type(source))
        twin = cls.__new__(cls)
        twin.__dict__.update(source.__dict__)
        twin._buffers = dict(source._buffers)
        twin._non_persistent_buffers_set = set(source._non_persistent_buffers_set)
        twin.pack()
        return twin

    def pack(self) -> None:
        w = self.weight.detach()
        self.panel = kernels() is not None
        data = panels(w) if self.panel else torch.ops.mkldnn._reorder_linear_weight(w, 8)
        if self.panel:
            self.register_buffer("panels", data, persistent=False)  # (P, K, 16): an input of a compiled graph
        else:
            self.onednn = data  # opaque: eager only (module docstring)
        self.packed_version = version(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        w = self.weight
        if rows < MIN_ROWS or x.dtype != w.dtype or not x.is_cpu or torch.is_grad_enabled():
            return super().forward(x)
        x2 = x.reshape(rows, -1)  # (rows, K)
        if self.panel:
            out = panel_product(x2, w, self.panels, self.packed_version)  # (rows, N)
        elif torch.compiler.is_compiling() or version(w) != self.packed_version:
            return super().forward(x)
        else:
            out = onednn_product(x2, self.onednn)  # (rows, N)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)  # (..., N)


def panel_product(x2: Tensor, weight: Tensor, panels: Tensor, packed_version: int) -> Tensor:
    """x2 (rows, K) @ weight (N, K)^T over its panels, plainly if the weight changed since."""
    return torch.ops.torchformer.panel_linear(x2, weight, panels, packed_version)


def onednn_product(x2: Tensor, copy: Tensor) -> Tensor:
    """x2 (rows, K) times oneDNN's packed copy of the weight -> (rows, N)."""
    return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), copy, None, "none", [], "")


@functools.cache
def twin_class(cls: type[Linear]) -> type[PackedLinear]:
    """PackedLinear for ``Linear``; for a subclass (the LM head's soft-cap), a class whose MRO puts
    the subclass's forward first, its ``super().forward`` reaching the packed product."""
    return PackedLinear if cls is Linear else type(f"Packed{cls.__name__}", (cls, PackedLinear), {})


def packable(module: nn.Module) -> bool:
    return isinstance(module, Linear) and not isinstance(module, PackedLinear) and available(module.weight)


def pack(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap every packable Linear of ``model`` for its twin; returns (owner, name, original) per
    swap, for ``unpack``. A Linear already packed (a nested scope) is left to its scope."""
    swaps = []
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if packable(child):
                setattr(owner, name, PackedLinear.of(child))
                swaps.append((owner, name, child))
    return swaps


def unpack(swaps: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Put the originals back (their copies go with the twins)."""
    for owner, name, original in reversed(swaps):
        setattr(owner, name, original)
