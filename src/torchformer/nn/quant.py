"""Weight-only quantized linears: int8 with one scale per output row (or per group: GGUF's Q8_0 is
int8 with one scale per 32 inputs), int4 with one scale per group.

Legend: N out features, K in features, G group size, rows = the product of x's leading dims.
Both are symmetric (zero maps to zero, no zero point): int8 q = round(w / s), s = max|w_row| / 127
(or max|w_group| / 127), q in [-127, 127]; int4 q = round(w / s), s = max|w_group| / 7, q in
[-7, 7], stored + 8 as a nibble, two per byte: byte j of a group holds input j of the group (low
nibble) and input j + G/2 (high nibble), so each nibble plane meets a contiguous half of the
group's inputs. (Measured: even/odd nibbles, which meet strided inputs, made inductor's loop ~10x
slower.) The weight is q * s; activations stay in their dtype (the CPU kernels of
fast/quant_panels.py, which replace these modules where they run, round them to 8 bits per block).

Decoding reads every weight once per token, so bytes are speed (benchmarks/RESULTS.md, decode:
535 tok/s for int8 against 224 for fp32, compiled, batch 1). Compiled, the few-row product is
nn.linear's multiply + sum
over the dequantised expression, which inductor fuses into one reduction that reads the integer
bytes and never writes an fp32 weight (the gpt-fast approach to weight-only int8/int4). Eager,
and for long prefills, the weight is dequantised then multiplied: exactly the reference.
The modules hold buffers, not parameters: weight-only quantization is for inference, and a
forward in training mode says so rather than letting an optimizer find nothing to update.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .linear import COMPILED_ROWS, linear, rowwise_product

INT8_MAX, INT4_MAX = 127, 7


def symmetric_scale(w: Tensor, qmax: int) -> Tensor:
    """max|w| / qmax over the last dim (fp32); an all-zero row or group gets scale 1, not 0/0."""
    amax = w.detach().float().abs().amax(-1)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


BLOCK_BYTES = 8 << 20  # fp32 working set per block of rows while quantizing


def row_blocks(n: int, k: int, multiple: int = 1) -> list[slice]:
    """Blocks of output rows to quantize one at a time (each a multiple of ``multiple`` rows but the
    last): both schemes are row-local, and a whole matrix in fp32 (a 128k-vocabulary head: 1 GB,
    several temporaries deep) would dwarf the integer result, all a quantizing loader should hold."""
    step = max(1, BLOCK_BYTES // (4 * max(1, k))) // multiple * multiple or multiple
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def quantize_by_blocks(w: Tensor, quantize_rows, write, *, multiple: int = 1, on_block=None) -> None:
    """``write(rows, *quantize_rows(w[rows]))`` for each block of ``row_blocks``; ``on_block(w[rows])``
    after each (a loader gives the block's mapped pages back there). On the meta device (weight_bytes,
    `torchformer plan --quantize`) the whole matrix is one block: nothing is allocated there, and
    each op on meta tensors costs Python time (llama3-8b int4: 3611 blocks, 20 s; one block each: <1 s)."""
    blocks = [slice(0, w.shape[0])] if w.is_meta else row_blocks(*w.shape, multiple)
    for rows in blocks:
        write(rows, *quantize_rows(w[rows]))
        if on_block is not None:
            on_block(w[rows])


class QuantLinear(nn.Module):
    """Shared forward; subclasses define ``dequantized()`` -> (N, K) float32 and ``from_linear``,
    and ``cpu_product(x2)`` for the activation dtypes in ``cpu_product_dtypes`` (a product over
    the integer bytes, run on the CPU without autograd)."""

    cpu_product_dtypes: tuple[torch.dtype, ...] = ()

    in_features: int
    out_features: int
    bias: Tensor | None

    def _init_bias(self, bias: Tensor | None) -> None:
        self.training = False  # inference-only (see forward)
        # Same state-dict key as nn.Linear's bias; a buffer so nothing can train it.
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantized(self) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def scheme_type(cls) -> type[QuantLinear]:
        """The scheme's portable module class (a module in another layout names its scheme's)."""
        return cls

    def rows_product(self, x2: Tensor) -> Tensor:
        """Compiled few-row product x2 (rows, K) -> (rows, N), dequantising inside the reduction."""
        return rowwise_product(x2, self.dequantized())

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            raise ValueError(
                f"{self.scheme_type().__name__}: a weight-only quantized model cannot be trained (its weights are "
                "integer buffers); call model.eval(), or train the float model and quantize it afterwards"
            )
        rows = x.numel() // max(1, x.shape[-1])
        if torch.compiler.is_compiling() and 1 <= rows <= COMPILED_ROWS:  # trace-time choice, as in nn.linear
            out = self.rows_product(x.reshape(rows, -1).float()).to(x.dtype)  # (rows, N)
            out = out if self.bias is None else out + self.bias.to(x.dtype)
            return out.reshape(*x.shape[:-1], self.out_features)  # (..., N)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.dtype in self.cpu_product_dtypes and x.is_cpu and not (x.requires_grad and torch.is_grad_enabled()):
            out = self.cpu_product(x.reshape(rows, -1))  # (rows, N): the integer weights as they are
            out = out if bias is None else out + bias
            return out.reshape(*x.shape[:-1], self.out_features)  # (..., N)
        return linear(x, self.dequantized().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    """int8 weights (N, K), fp32 scales: one per output row (N,), or with ``group_size`` one per
    group of G inputs (N, K // G)."""

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None, group_size: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.group_size = group_size
        if group_size is not None:
            self.cpu_product_dtypes = ()  # torch's int8 kernel takes row scales only
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self._init_bias(bias)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, group_size: int | None = None, on_block=None) -> Int8Linear:
        w = lin.weight.detach()  # (N, K)
        N, K = w.shape
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        shape = (N,) if group_size is None else (N, K // group_size)
        scale = torch.empty(shape, dtype=torch.float32, device=w.device)  # (N,) or (N, K/G)

        def write(rows: slice, q_rows: Tensor, s_rows: Tensor) -> None:
            q[rows], scale[rows] = q_rows, s_rows

        quantize_by_blocks(w, lambda rows: cls.quantize_rows(rows, group_size), write, on_block=on_block)
        return cls(q, scale, lin.bias, group_size)

    @staticmethod
    def quantize_rows(w: Tensor, group_size: int | None = None) -> tuple[Tensor, Tensor]:
        """w (n, K) -> q (n, K) int8 and the scales, (n,) or (n, K/G) fp32."""
        n, K = w.shape
        G = K if group_size is None else group_size
        groups = w.to(torch.float32, copy=True).reshape(n, K // G, G)  # a copy: quantized in place below
        scale = symmetric_scale(groups, INT8_MAX)  # (n, K/G)
        q = groups.div_(scale[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).reshape(n, K)
        return q, scale[:, 0] if group_size is None else scale

    def dequantized(self) -> Tensor:
        N, K = self.qweight.shape
        if self.group_size is None:
            return self.qweight.float() * self.scale[:, None]  # (N, K)
        groups = self.qweight.float().reshape(N, K // self.group_size, self.group_size)  # (N, K/G, G)
        return (groups * self.scale[..., None]).reshape(N, K)

    def extra_repr(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        return super().extra_repr() + group

    def values(self, rows: slice) -> tuple[Tensor, Tensor]:
        """The signed values and scales of rows ``rows`` (what ``quantize_rows`` gives)."""
        return self.qweight[rows], self.scale[rows]

    # Measured over 4 layers of the Llama-3.2-1B shape (243M weights, 2 threads, best of 5): bf16
    # activations 1 / 8 / 64 rows: 67 / 98 / 586 ms against 305 / 976 / 1154 ms for dequantise +
    # matmul. With fp32 activations torch's kernel is far slower (448 ms / 4.5 s / 23 s): fp32
    # keeps the dequantised product.
    cpu_product_dtypes = (torch.bfloat16,)

    def cpu_product(self, x2: Tensor) -> Tensor:
        """x2 (rows, K) bf16 against the int8 weight by torch's int8 weight-only kernel: each row of
        weights is converted as it is read, never a float copy of the matrix (what a prefill did).
        Compiled, through ``int8_weight_mm`` (inductor's own lowering fails in a compile region)."""
        product = int8_weight_mm if torch.compiler.is_compiling() else torch._weight_int8pack_mm
        return product(x2.contiguous(), self.qweight, self.scale.to(x2.dtype))  # (rows, N)


@torch.library.custom_op("torchformer::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    """torch's ``_weight_int8pack_mm`` as an opaque op for compiled steps. Inductor lowers the aten
    op to the same library call, but inside a nested compile region (models/regions.py: the big
    layers of a compiled step) that lowering fails on an input it has not materialized (torch 2.13:
    "LoweringException: AssertionError: <class 'torch._inductor.ir.Pointwise'>"; a decode batch of
    more than COMPILED_ROWS rows on a CPU without the project's kernels, issue 25); a custom op's
    inputs are materialized first."""
    return torch._weight_int8pack_mm(x, qweight, scale)  # (rows, N)


@int8_weight_mm.register_fake
def _(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


class Int4Linear(QuantLinear):
    """int4 weights packed two per byte (N, K // 2) uint8, fp32 scales per group (N, K // G)."""

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None, group_size: int) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape[0], 2 * qweight.shape[1]
        self.group_size = group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self._init_bias(bias)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, group_size: int, on_block=None) -> Int4Linear:
        w = lin.weight.detach()  # (N, K)
        N, K = w.shape
        packed = torch.empty(N, K // 2, dtype=torch.uint8, device=w.device)
        scale = torch.empty(N, K // group_size, dtype=torch.float32, device=w.device)  # (N, K/G)

        def write(rows: slice, q_rows: Tensor, s_rows: Tensor) -> None:
            packed[rows], scale[rows] = cls.pack(q_rows, group_size), s_rows

        quantize_by_blocks(w, lambda rows: cls.quantize_rows(rows, group_size), write, on_block=on_block)
        return cls(packed, scale, lin.bias, group_size)

    @staticmethod
    def quantize_rows(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
        """w (n, K) -> the signed values q (n, K) int16 in [-7, 7] and the group scales (n, K/G) fp32."""
        n, K = w.shape
        groups = w.to(torch.float32, copy=True).reshape(n, K // group_size, group_size)  # (n, K/G, G)
        scale = symmetric_scale(groups, INT4_MAX)  # (n, K/G)
        q = groups.div_(scale[..., None]).round_().clamp_(-INT4_MAX, INT4_MAX).to(torch.int16)
        return q.reshape(n, K), scale

    @classmethod
    def from_values(cls, q: Tensor, scale: Tensor, bias: Tensor | None, group_size: int) -> Int4Linear:
        """From the signed values q (N, K) in [-8, 7] and their scales (N, K / G)."""
        return cls(cls.pack(q, group_size), scale, bias, group_size)

    @staticmethod
    def pack(q: Tensor, group_size: int) -> Tensor:
        """Signed values q (n, K) in [-8, 7] -> (n, K / 2) bytes, two nibbles each (module docstring)."""
        n, K = q.shape
        halves = (q + 8).to(torch.uint8).reshape(n, K // group_size, 2, group_size // 2)  # (n, K/G, 2, G/2)
        return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, K // 2)  # (n, K/2)

    def nibbles(self) -> tuple[Tensor, Tensor]:
        """The signed values of each group's first and second half: (N, K/G, G/2) float each."""
        N, K, G = self.out_features, self.in_features, self.group_size
        packed = self.qweight.view(N, K // G, G // 2)
        return (packed & 0xF).float() - 8, (packed >> 4).float() - 8

    def unpacked(self) -> Tensor:
        """The signed int4 values (N, K) as int16."""
        return self.values(slice(None))[0]

    def values(self, rows: slice) -> tuple[Tensor, Tensor]:
        """The signed values (n, K) int16 and scales (n, K/G) of rows ``rows`` (as ``quantize_rows``)."""
        G = self.group_size
        packed = self.qweight[rows].view(-1, self.in_features // G, G // 2)  # (n, K/G, G/2)
        halves = torch.stack([(packed & 0xF), (packed >> 4)], dim=2).to(torch.int16) - 8  # (n, K/G, 2, G/2)
        return halves.reshape(packed.shape[0], self.in_features), self.scale[rows]

    def rows_product(self, x2: Tensor) -> Tensor:
        """Per row: sum over each group's two halves against the nibble planes, times the group's
        scale, summed over groups (the scale leaves the inner loop; one fused loop per row)."""
        K, G = self.in_features, self.group_size
        low, high = self.nibbles()  # (N, K/G, G/2) each
        out = []
        for row in x2.unbind(0):
            halves = row.view(K // G, 2, G // 2)  # (K/G, 2, G/2)
            per_group = (low * halves[:, 0] + high * halves[:, 1]).sum(-1)  # (N, K/G)
            out.append((per_group * self.scale).sum(-1))  # (N,)
        return torch.stack(out, dim=0)  # (rows, N)

    def dequantized(self) -> Tensor:
        N, K, G = self.out_features, self.in_features, self.group_size
        groups = self.unpacked().reshape(N, K // G, G).float()  # (N, K/G, G)
        return (groups * self.scale[..., None]).reshape(N, K)  # (N, K)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"
