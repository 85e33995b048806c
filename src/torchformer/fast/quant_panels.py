"""Quantized linears in the CPU kernels' layout: the int8 / int4 weights of nn/quant.py in panels.

Legend: N out features, K in features, G group size, P = ceil(N / 16) panels, rows = the product
of x's leading dims.

A decode step reads every weight once, so a quantized model is only as fast as its product reads
the integer bytes. torch's int8 / int4 weight-only CPU kernels read them at 3.6 / 5.4 GB/s for one
row here (and only with bf16 activations); the kernels of csrc/quantized.cpp read the same bytes
from 16-row panels and multiply them as integers, llama.cpp's way: each row of x is quantized to
int8 per block of 32 inputs, a 64-byte line of weights meets it in one or two integer dot-product
instructions (AVX512-VNNI where the CPU has it), and each block's sum is scaled once. So no
prefill ever writes an fp32 copy of a matrix, and no weight is widened to fp32.

The layout belongs to the CPU that runs it, so it is made at run time and never saved:
``prepare(model)`` swaps each ``Int8Linear`` / ``Int4Linear`` for its panel twin (one copy of the
bytes: the portable module is dropped), and a twin's state dict is the portable module's, so
``tfm.save`` writes the same checkpoint either way. ``tfm.quantize`` and ``tfm.load`` call
``prepare``; it does nothing where the kernels are not built (no AVX-512, no compiler,
``TORCHFORMER_NATIVE=0``), on other devices, or for shapes the kernels do not take (K not a
multiple of 4 for int8, a group not a multiple of 8 for int4).

Numerics: the weights are exactly the reference module's (q * s). The activations are rounded to
8 bits per block of B inputs (B = 32, or the largest power of two dividing the group, K and 32;
scale max|x| / 127), the one approximation, as llama.cpp makes for its Q8_0 / Q4_0 products: a
product differs from x times the dequantized weight by at most sum over blocks of (s_x / 2) times
the block's sum of |w| (tests/fast/test_formats.py bounds it). So the kernels run only under
``torch.no_grad`` / ``inference_mode`` (generation, serving, evaluation): grad mode (QLoRA
training, autograd), training mode and other devices take the reference path
(``QuantLinear.forward`` over ``dequantized()``), which unpacks the panels exactly and does not
round the activations.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ..nn.quant import QuantLinear, quantize_by_blocks, row_blocks
from . import two_level
from .native import kernels
from .panels import LANES, from_stream, streamed, to_stream


@functools.cache
def ops_ready() -> bool:
    """Whether the format kernels are built here (and their fake kernels registered, so that
    torch.compile traces through them as opaque calls)."""
    if kernels() is None:
        return False
    torch.library.register_fake("torchformer::int8_mm")(lambda x, w, s, n, g, *_: x.new_empty((x.shape[0], n)))
    torch.library.register_fake("torchformer::int4_mm")(lambda x, w, s, n, g, *_: x.new_empty((x.shape[0], n)))
    torch.library.register_fake("torchformer::intn_mm")(lambda x, w, s, n, *_: x.new_empty((x.shape[0], n)))
    torch.library.register_fake("torchformer::int4_min_mm")(lambda x, w, s, m, n, g, *_: x.new_empty((x.shape[0], n)))
    torch.library.register_fake("torchformer::dequant_t")(lambda out, panels, scale, n, k, g, bits, w, p0, p1: None)
    torch.library.register_fake("torchformer::bf16_linear")(lambda x, w: x.new_empty((x.shape[0], w.shape[0])))
    torch.library.register_fake("torchformer::bf16_dot")(
        lambda x, w: x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    )
    return True


# A prefill on a CPU with bf16 matrix units (AMX): from BF16_ROWS rows on, interleaved int8 / int4 panels
# multiply x in bf16 through oneDNN's product over W^T in blocks of about BF16_BLOCK_BYTES
# (``bf16_product``), never the whole matrix at once. On the Intel Xeon of RESULTS.md's 1B tables a
# 512-token prefill took the integer kernels 3171 ms (int8) / 2600 (int4) against bf16's 1142; this
# route (with 512-row chunks, generation/steps.py) 1293 / 1276 against bf16's 1047. Blocks of 4 MB
# of W^T in one buffer reused block after block (the 1B gate/up joint at 512 rows: 1 MB 144 ms, 2 MB
# 46.5, 4 MB 28.1, 8 MB 24.1, the product alone 22.1; its down: 4 MB 13.1, 8 MB 21.9).
BF16_ROWS = 64
BF16_BLOCK_BYTES = 4 << 20


@functools.cache
def bf16_units() -> bool:
    """Whether this CPU takes prefills' quantized products in bf16: AMX tiles (oneDNN's bf16 product
    runs on them) and the kernels' ``dequant_t`` (AVX512-VBMI and -BF16); a twin keeps the answer
    when it is made (``PanelLinear.empty``)."""
    return ops_ready() and torch.cpu._is_amx_tile_supported() and torch.ops.torchformer.dequant_ready()


def from_panels(panels: Tensor, n: int) -> Tensor:
    """The inverse of ``panels``: (P, K', 16, ...) -> (N, K', ...)."""
    return panels.transpose(1, 2).reshape(-1, *panels.shape[1:2], *panels.shape[3:])[:n]


def finished(out: Tensor, x: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """A kernel's product (rows, N) (fp32; bf16 from a bf16 prefill) plus the bias, in x's dtype
    and leading shape (..., N)."""
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def fp32(t: Tensor) -> Tensor:
    """A scale buffer in fp32 to be written: ``t`` itself where it is (its memory as allocated),
    else an fp32 copy in the kernels' streamed memory (a refill of compacted scales)."""
    return t if t.dtype == torch.float32 else streamed(t.float())


def rows_in(x: Tensor) -> int:
    """The rows of x (..., K): the product of its leading dimensions."""
    return x.numel() // max(1, x.shape[-1])


def rows_of(x: Tensor) -> Tensor:
    """x (..., K) as the kernels take it: (rows, K) contiguous fp32."""
    return x.reshape(rows_in(x), -1).float().contiguous()


class PanelLinear(QuantLinear):
    """A quantized linear in panels; its state dict is its portable module's (``portable()``).
    Each twin also subclasses its portable class: it is that scheme's module, in another layout."""

    cpu_product_dtypes = ()  # the panels' product is forward's own (the portable one reads qweight)
    portable_names = ("qweight", "scale")  # the portable module's state besides its bias
    half_scales = True  # whether the kernel takes f16 scales (compact_scales)
    super_group = 0  # inputs per super-scale where the scales are two-level (fast/two_level.py), else 0
    ways = 1  # panels interleaved a group (``interleave``), 1: one after another
    LAID = ("panels", "scale")  # the tensors that hold a slab per panel: one stream where interleaved
    dequant_bits = 0  # the bits ``dequant_t`` takes of this format's interleaved panels (0: none)
    prefill_bf16 = False  # whether prefills multiply in bf16 (``bf16_units``, set when made)
    laid: tuple = ()  # interleaved: each LAID tensor's (shape past P, dtype), as ``in_order`` gives it back

    def __init__(self, source: QuantLinear) -> None:
        self.empty(source.out_features, source.in_features, getattr(source, "group_size", None), None)
        self.fill(source)
        self.interleave()

    def empty(self, n: int, k: int, group_size: int | None, bias: Tensor | None) -> None:
        """Shapes, bias and zeroed panels (``allocate``) for an n x k weight, to be written."""
        nn.Module.__init__(self)
        if not ops_ready():
            raise RuntimeError(f"{type(self).__name__}: the CPU kernels are not built here; keep {self.scheme_type()}")
        self.out_features, self.in_features = n, k
        self._init_bias(bias)
        self.allocate(group_size)
        self.register_buffer("super_scale", None, persistent=False)  # (P, K/SG, 16) f16: two-level scales only
        self.prefill_bf16 = bf16_units()

    @classmethod
    def of(cls, source: QuantLinear) -> PanelLinear:
        return cls(source)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, group_size: int | None = None, on_block=None) -> PanelLinear:
        """Quantized straight into panels, block by block of 16-row panels (``quantize_by_blocks``):
        never the portable module's copy, never an fp32 matrix."""
        twin = cls.__new__(cls)
        twin.empty(lin.out_features, lin.in_features, group_size, lin.bias)
        w = lin.weight.detach()

        def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
            return cls.quantize_rows(rows, group_size)

        quantize_by_blocks(w, quantize_rows, twin.write, multiple=LANES, on_block=on_block)
        twin.compact_scales()
        twin.interleave()
        return twin

    def allocate(self, group_size: int | None) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def write(self, rows: slice, q: Tensor, scale: Tensor) -> None:  # pragma: no cover - abstract
        """Rows ``rows`` (starting at a panel) from their signed values q (n, K) and scales."""
        raise NotImplementedError

    @classmethod
    def scheme_type(cls) -> type[QuantLinear]:
        """The portable class a twin also subclasses (Int8Linear for Int8Panels, ...)."""
        return next(c for c in cls.__mro__ if issubclass(c, QuantLinear) and not issubclass(c, PanelLinear))

    def forward(self, x: Tensor) -> Tensor:
        if not self.runs(x):
            # The reference: training error, other devices, and any product under grad mode (QLoRA
            # trains over these modules: its forward stays exact, activations unrounded).
            return super().forward(x)
        return self.finish(self.multiply(x), x)

    def runs(self, x: Tensor) -> bool:
        """Whether the kernel takes x: inference on the CPU (module docstring)."""
        return not self.training and x.is_cpu and not torch.is_grad_enabled()

    def finish(self, out: Tensor, x: Tensor) -> Tensor:
        return finished(out, x, self.bias, self.out_features)

    def multiply(self, x: Tensor) -> Tensor:
        """x (..., K) -> (rows, N): the kernels' integer product over fp32 rows (``product``), or
        for a prefill where ``prefill_bf16`` the bf16 one (``bf16_product``), in bf16: x and the
        output never go through fp32 there (at 512 rows that round trip and a copy of each block's
        output added ~5 ms to a 1B gate/up's 13)."""
        rows = rows_in(x)
        if self.prefill_bf16 and rows >= BF16_ROWS and self.ways > 1 and self.dequant_bits:
            return self.bf16_product(x.reshape(rows, -1).to(torch.bfloat16))
        return self.product(rows_of(x))

    def bf16_product(self, xb: Tensor) -> Tensor:
        """xb (rows, K) bf16 @ W^T -> (rows, N) bf16, W^T made from the panels a block of whole
        panel groups at a time, each block's product written in place into its columns."""
        N, K, P, ways = self.out_features, self.in_features, -(-self.out_features // LANES), self.ways
        step = max(1, BF16_BLOCK_BYTES // (K * LANES * 2 * ways)) * ways  # panels a block, whole groups
        out = xb.new_empty((xb.shape[0], N))
        wt = xb.new_empty((K, min(P, step) * LANES))  # W^T's block, reused
        group, bits = self.group_size or K, self.dequant_bits
        for p0 in range(0, P, step):
            p1 = min(P, p0 + step)
            torch.ops.torchformer.dequant_t(wt, self.panels, self.scale, N, K, group, bits, ways, p0, p1)
            n0, n1 = p0 * LANES, min(N, p1 * LANES)
            torch.mm(xb, wt[:, : n1 - n0], out=out[:, n0:n1])
        return out

    def product(self, x2: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def portable(self) -> QuantLinear:  # pragma: no cover - abstract
        raise NotImplementedError

    def dequantized(self) -> Tensor:  # (N, K) float32: the reference product's weight (autograd, QLoRA)
        return self.portable().dequantized()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.portable()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if not any(key.startswith(prefix) and "." not in key[len(prefix) :] for key in state_dict):
            # Nothing of this module's (a partial load, strict=False: a GGUF file's float tensors, an
            # adapter): its keys are missing, and no portable copy is built and repacked for nothing
            # (the Llama-3.2-1B Q4_0 file's load peaked 1.7 GB higher on those copies).
            names = (*self.portable_names, *(("bias",) if self.bias is not None else ()))
            missing.extend(prefix + name for name in names)
            return
        source = self.portable()
        source._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        ways, before = self.ways, {name: self._buffers[name] for name in self.LAID}
        if ways > 1:  # every row is written again: in order first, into new zeros
            self.allocate(self.group_size)
            self.ways, self.laid = 1, ()
        self.fill(source)  # repack what was loaded, then lay it out as it was
        self.interleave(ways if self.interleaves() else 1)
        after = {name: self._buffers[name] for name in self.LAID}
        if all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(before.values(), after.values())):
            for name, t in before.items():  # into the bytes they had: a joint's views (fast/joint.py) see them
                if t is not after[name]:
                    self._buffers[name] = t.copy_(after[name])

    def fill(self, source: QuantLinear) -> None:
        """Every row and the bias from ``source`` (allocated already, panels in order), block by block."""
        self._init_bias(source.bias)
        self.scale, self.super_scale, self.super_group = fp32(self.scale), None, 0  # compacted again
        for rows in row_blocks(self.out_features, self.in_features, LANES):
            self.write(rows, *source.values(rows))
        self.compact_scales(source)

    def interleave(self, ways: int | None = None) -> None:
        """Lay each group of ``ways`` panels out as one stream with their scales (and minimums)
        inside it (fast/panels.py ``to_stream``; None: the kernels' ``torchformer::panel_ways``, 4
        in the AVX-512 build and 1 elsewhere, where one unit is one 64-byte line and the scales
        one-level: int8 and int4 panels; 1: the panels and scales back in their own tensors, in
        order). ``panels`` then holds the stream and each other LAID tensor is an empty one of its
        dtype; the products take the layout as they find it (``ways``). One row of x reads a
        thread's groups as one stream instead of four panels' and four scales' streams. Measured
        over the 1B shape's projections as ~826 MB of int4 group-64 panels (one thread, an
        AVX512-VNNI EPYC, best of 4, three alternations): one row read 74-80% of the plain read with
        four panel streams and 93-108% interleaved (with the scales a second stream then); the
        scales inside the stream lift the 1B shape's int4 group-64 gate/up from 80-82% to 87-89% of
        the plain read, its down from 65-68% to 74-75% (csrc/quantized.cpp). A copy, a matrix at a
        time, its in-order pages given back as they are copied (fast/panels.py ``to_stream``), which
        a joint (fast/joint.py) sees as a member whose tensors changed (a load writes into the bytes
        the member had: ``_load_from_state_dict``)."""
        if ways is None:
            ways = torch.ops.torchformer.panel_ways() if self.interleaves() else 1
        if ways == self.ways:
            return
        if self.ways > 1:
            parts = from_stream(self._buffers["panels"], list(self.laid), self.weight_groups(), self.ways)
            for name, t in zip(self.LAID, parts):
                self._buffers[name] = t
            self.ways, self.laid = 1, ()
        if ways > 1:
            parts = [self._buffers[name] for name in self.LAID]
            self.laid = tuple((tuple(t.shape[1:]), t.dtype) for t in parts)
            self._buffers["panels"] = to_stream(parts, self.weight_groups(), ways, consume=True)  # its own, dropped
            for name, t in zip(self.LAID[1:], parts[1:]):
                self._buffers[name] = t.new_empty(0)  # its dtype: the kernels read the values from the stream
            self.ways = ways

    def interleaves(self) -> bool:
        """Whether the kernels take this format's panels interleaved (``interleave``)."""
        return self.super_scale is None

    def in_order(self, name: str) -> Tensor:
        """Buffer ``name`` (one of LAID) with its panels one after another, whatever ``ways``."""
        if self.ways == 1:
            return self._buffers[name]
        return from_stream(self._buffers["panels"], list(self.laid), self.weight_groups(), self.ways)[
            self.LAID.index(name)
        ]

    def weight_groups(self) -> int:
        """Groups of inputs with a scale of their own in each row (1: one scale per row)."""
        return self.in_features // (self.group_size or self.in_features)

    def compact_scales(self, source: QuantLinear | None = None) -> None:
        """Keep the scales in the file's two-level form where ``source`` carries it (GGUF's
        K-quants, fast/two_level.py: an int8 per group under an f16 per super-block), else in f16
        where f16 holds every one exactly (GGUF's Q8_0 / Q4_0 / Q5_0 block scales: an f16 d each):
        the kernel widens them as it reads (csrc/quantized.cpp), so a group of 32 int8 weights reads
        34 bytes instead of 36, of 32 int4 weights 18 instead of 20. Scales of our own quantization
        are fp32 values and stay fp32."""
        parts = two_level.fits(getattr(source, "scale_parts", None), self.scale, self.group_size or self.in_features)
        if parts is not None and self.two_level_ok(source):
            self.scale, self.super_scale = (streamed(t) for t in parts)
            self.super_group = source.scale_parts.size
            return
        if not self.half_scales:
            return
        half = self.scale.half()
        if torch.equal(half.float(), self.scale):
            self.scale = streamed(half)

    def two_level_ok(self, source: QuantLinear) -> bool:
        """Whether the rest of the format takes two-level scales too (Int4MinPanels: its minimums)."""
        return True

    def full_scales(self) -> Tensor:
        """The scales (P, K/G, 16) fp32, whatever form the panels keep them in."""
        if self.super_scale is None:
            return self.in_order("scale").float()
        return two_level.expanded(self.scale, self.super_scale)

    def super_args(self) -> tuple[Tensor | None, int, int]:
        """The ops' (super_scale, super_group, ways) arguments."""
        return self.super_scale, self.super_group, self.ways
