"""GGUF tensors -> torch: float types as they are, Q4_0 into ``Int4Linear`` (the same numbers and
the same nibble order), Q8_0 and Q5_0 into ``Int8Linear`` with a scale per 32 inputs, Q6_K into
``Int8Linear`` with a scale per 16 inputs and Q4_K into ``Int4MinLinear`` (each the same numbers),
every other type dequantized at load by the ``gguf`` package.

Q4_0 (llama.cpp ggml-quants): blocks of 32 inputs, an f16 scale d and 16 bytes; byte j holds input
j (low nibble) and input j + 16 (high nibble), weight = d * (nibble - 8). nn/quant.py's Int4Linear
with group 32 stores byte j of a group as input j (low) and j + G/2 (high), value + 8, times an fp32
scale: the bytes are copied as they are and d widened to fp32, so its dequantized weight equals
gguf's dequantization bit for bit. Q8_0 (blocks of 32 inputs: an f16 scale d and 32 int8 q,
weight = d * q) is Int8Linear with group 32: q copied as it is, d widened to fp32. So is Q5_0
(blocks of 32: an f16 d, 4 bytes qh whose bit j is input j's fifth bit, 16 bytes as Q4_0's;
weight = d * (q - 16), q - 16 in [-16, 15]): llama.cpp's quantizer writes it where a K-quant does
not fit a width (a Q4_K_M file's 1408-wide ffn_down).

The K-quants (ggml-quants' super-blocks of 256 inputs) are read into the same modules, their
numbers kept, so each module's dequantized weight equals gguf's bit for bit:
- Q6_K (210 bytes: ql[128], qh[64], 16 int8 scales sc, an f16 d): weight = d * sc_j * q per 16
  inputs, q = (4 low bits | 2 high bits << 4) - 32 in [-32, 31]. Symmetric: Int8Linear with group
  16, q as it is, scale d * sc_j (exact in fp32: 11 + 8 significant bits).
- Q4_K (144 bytes: f16 d and dmin, 12 bytes of 6-bit scales sc_j and minimums m_j, qs[128]):
  weight = d * sc_j * u - dmin * m_j per 32 inputs, u in [0, 15]. Int4MinLinear with group 32:
  u, scale d * sc_j and minimum dmin * m_j (both exact in fp32).
Each also carries its scales' two-level form (``scale_parts`` / ``minimum_parts``, fast/two_level.py:
the int8 sc or m per group under the f16 d or dmin per 256), which the CPU kernels' panels keep
instead of the fp32 products (Q4_K 4.63 bits a weight instead of 6).
The kernels' twin of an Int8Linear whose values fit 5 or 6 bits holds that many bits a weight
(fast/quant_panels.py ``low_bits``: int4's nibbles plus a plane of the high bits), so Q5_0 runs
from 5.5 bits a weight (its f16 scales) and Q6_K from 6.56 (its two-level scales), as the file
stores them, instead of int8's 8.5 / 8.56.
Bit order, per super-block: Q4_K's qs byte 32c + i holds input 64c + i (low nibble) and 64c + 32 + i
(high); Q6_K's ql byte 64h + i holds input 128h + i (low) and 128h + 64 + i (high), its qh byte
32h + i bits 2j..2j+1 input 128h + 32j + i's high bits; the 12 scale bytes of Q4_K hold sc_0..3 and
m_0..3 in the low 6 bits of bytes 0-3 and 4-7, sc_4..7 / m_4..7 in byte 8+j's low / high nibble,
topped by the 2 spare bits of bytes j / 4 + j.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor

from ...fast.formats import fits
from ...fast.two_level import TwoLevel
from ...host_memory import file_mappings, release_mapped, release_mapped_range, trim
from ...nn.quant import Int4Linear, Int8Linear, QuantLinear, row_blocks
from ...nn.quant_min import Int4MinLinear
from .container import FLOAT_TYPES, GGUFFile, gguf_module

Q4_0_GROUP = Q8_0_GROUP = Q4_K_GROUP = 32
Q6_K_GROUP = 16
QK_K = 256  # inputs per K-quant super-block
TRIM_EVERY = 4  # FileRows blocks between trims
COPY_CHUNK = 16 << 20  # bytes of a tensor copied out of the file's mapping at a time (raw_rows)


def raw_rows(f: GGUFFile, name: str) -> Tensor:
    """A tensor's stored bytes or values as a torch tensor, one row per output row; a copy (the
    reader maps the file read-only, and a model owns its weights), made COPY_CHUNK bytes at a time,
    each chunk's file pages leaving this process's resident set once copied (a later read faults
    them back in from the file): a load held the whole file besides the model it made, and a whole
    tensor's pages beside its copy (a 1B shape's Q8_0 table: +266 MiB of peak)."""
    data = np.asarray(f.tensors[name].data)
    flat = data.reshape(-1).view(np.uint8)
    out = torch.empty(flat.nbytes, dtype=torch.uint8)
    dest = out.numpy()
    for start in range(0, flat.nbytes, COPY_CHUNK):
        part = flat[start : start + COPY_CHUNK]
        dest[start : start + part.nbytes] = part
        release_mapped_range(part.ctypes.data, part.ctypes.data + part.nbytes)
    if f.type_name(name) == "BF16":  # stored as raw 16-bit words
        return out.view(torch.bfloat16).reshape(f.torch_shape(name))
    return out.view(torch.from_numpy(np.empty(0, dtype=data.dtype)).dtype).reshape(data.shape)


def mapped_view(f: GGUFFile, name: str) -> Tensor:
    """A tensor's stored bytes or values over the reader's read-only mapping of the file, no copy:
    for a loader that copies what it keeps (assembled), never for a model's own weights."""
    with warnings.catch_warnings():  # read-only: torch warns that writing to it is undefined
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(f.tensors[name].data))


def float_tensor(f: GGUFFile, name: str, rows: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """The tensor of ``shape`` in ``dtype`` from its rows (raw_rows, after any row transform or an
    expert's slice)."""
    kind = f.type_name(name)
    if kind in FLOAT_TYPES:
        return rows.reshape(shape).to(dtype)
    # Dequantized a block of rows at a time into the result: gguf's numpy dequantization of a whole
    # tensor holds it in float32 and its intermediates besides (a Llama-3.2-1B Q4_0 file's Q6_K
    # token table: 0.2 GB of bytes, ~1 GB of float32 each; the load peaked at 4.3 GB).
    gguf, kind_id = gguf_module(), f.tensors[name].tensor_type
    flat = (rows.reshape(rows.shape[0], -1) if rows.dim() > 1 else rows.reshape(1, -1)).contiguous()  # (rows, bytes)
    per_row = math.prod(shape) // flat.shape[0]

    def values(block: slice) -> Tensor:  # (rows, per_row) float32
        return torch.from_numpy(gguf.quants.dequantize(flat[block].numpy(), kind_id)).reshape(-1, per_row)

    return by_rows(flat.shape[0], per_row, dtype, values).reshape(shape)


def blocks(rows: Tensor, shape: tuple[int, int], payload: int) -> tuple[Tensor, Tensor]:
    """A Q4_0 / Q8_0 matrix's rows (N, K / 32 * (2 + payload)) uint8 -> its f16 block scales widened
    to fp32 (N, K/32) and the blocks' payload bytes (N, K/32, payload)."""
    n, k = shape
    b = rows.reshape(n, k // Q4_0_GROUP, 2 + payload)  # (N, K/32, 2 + payload): f16 d, then the values
    return b[..., :2].contiguous().view(torch.float16).reshape(n, k // Q4_0_GROUP).float(), b[..., 2:]


def q4_0_linear(rows: Tensor, shape: tuple[int, int], bias: Tensor | None) -> Int4Linear:
    """Int4Linear (group 32) holding a Q4_0 matrix's bytes; rows: (N, K / 32 * 18) uint8."""
    scale, payload = blocks(rows, shape, Q4_0_GROUP // 2)
    qweight = payload.reshape(shape[0], shape[1] // 2).clone()  # (N, K/2): byte j = inputs j, j + 16 of a block
    return Int4Linear(qweight, scale, bias, Q4_0_GROUP)


def q8_0_linear(rows: Tensor, shape: tuple[int, int], bias: Tensor | None) -> Int8Linear:
    """Int8Linear (group 32) holding a Q8_0 matrix's values; rows: (N, K / 32 * 34) uint8."""
    scale, payload = blocks(rows, shape, Q8_0_GROUP)
    qweight = payload.contiguous().view(torch.int8).reshape(shape)  # (N, K)
    return Int8Linear(qweight, scale, bias, Q8_0_GROUP)


def q5_0_values(payload: Tensor) -> Tensor:
    """Q5_0 blocks' payload (..., 20): qh (4 bytes, bit j = input j's fifth bit), then 16 bytes as
    Q4_0's -> the blocks' values (..., 32) int32 in [-16, 15]."""
    qh = payload[..., :4].contiguous().view(torch.int32)  # (..., 1)
    fifth = (qh >> torch.arange(Q8_0_GROUP, dtype=torch.int32, device=payload.device)) & 1  # (..., 32)
    low = nibble_halves(payload[..., 4:]).to(torch.int32)  # (..., 32): inputs 0-15 low, 16-31 high
    return (low | (fifth << 4)) - 16


def q5_0_linear(rows: Tensor, shape: tuple[int, int], bias: Tensor | None) -> Int8Linear:
    """Int8Linear (group 32) holding a Q5_0 matrix's values; rows: (N, K / 32 * 22) uint8."""
    scale, payload = blocks(rows, shape, 20)  # (N, K/32), (N, K/32, 20)
    q = q5_0_values(payload).to(torch.int8).reshape(shape)  # (N, K) in [-16, 15]
    return Int8Linear(q, scale, bias, Q8_0_GROUP)


def super_blocks(rows: Tensor, shape: tuple[int, int], size: int) -> Tensor:
    """A K-quant matrix's rows (N, K / 256 * size) uint8 -> (N, K / 256, size)."""
    n, k = shape
    return rows.reshape(n, k // QK_K, size)


def half(b: Tensor) -> Tensor:
    """(..., 2) uint8 -> (..., 1) the f16 they hold."""
    return b.contiguous().view(torch.float16)


def nibble_halves(b: Tensor) -> Tensor:
    """(..., L) bytes -> (..., 2L): the low nibbles, then the high ones."""
    return torch.cat([b & 0xF, b >> 4], dim=-1)


def q6_k_scales(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q6_K super-blocks (N, K/256, 210) -> their sub-scales sc (N, K/256, 16) int8 and d (N, K/256, 1) f16."""
    return b[..., 192:208].contiguous().view(torch.int8), half(b[..., 208:])


def q6_k_values(b: Tensor) -> Tensor:
    """Q6_K super-blocks (n, K/256, 210) -> their values (n, K) int8 in [-32, 31]."""
    n = b.shape[0]
    ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(4, 1)
    low = nibble_halves(ql)  # (n, K/256, 2, 128): input 128h + i's low 4 bits
    high = ((qh >> shifts) & 3).reshape(low.shape)  # input 128h + 32j + i's top 2 bits
    return (low | (high << 4)).sub_(32).view(torch.int8).reshape(n, -1)  # u - 32, two's complement


def q6_k_linear(rows: Tensor, shape: tuple[int, int], bias: Tensor | None) -> Int8Linear:
    """Int8Linear (group 16) holding a Q6_K matrix's values; rows: (N, K / 256 * 210) uint8."""
    n, k = shape
    b = super_blocks(rows, shape, 210)  # (N, K/256, 210)
    sc, d = q6_k_scales(b)  # (N, K/256, 16), (N, K/256, 1)
    q = by_rows(n, k, torch.int8, lambda rows: q6_k_values(b[rows]))  # (N, K)
    scale = (d.float() * sc.float()).reshape(n, k // Q6_K_GROUP)  # (N, K/16)
    module = Int8Linear(q, scale, bias, Q6_K_GROUP)
    module.scale_parts = TwoLevel(sc.reshape(n, -1), d.reshape(n, -1), QK_K)
    return module


def by_rows(n: int, k: int, dtype: torch.dtype, values) -> Tensor:
    """(n, k) of ``dtype`` made by ``values(rows: slice)`` one block of rows at a time (nn/quant.py
    row_blocks: an 8 MB float32 working set): unpacking or dequantizing a whole matrix at once held
    several temporaries of its size (a 1B head: ~1.3 GB)."""
    out = torch.empty(n, k, dtype=dtype)
    for rows in row_blocks(n, k):
        out[rows] = values(rows)
    return out


def q4_k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's 12 scale bytes (..., 12) -> the 6-bit sc and m of its 8 sub-blocks (..., 8) each."""
    lo, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (top & 0xF) | ((lo >> 2) & 0x30)], dim=-1)
    m = torch.cat([mid & 63, (top >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return sc, m


def q4_k_fields(b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Q4_K super-blocks (n, K/256, 144) -> d, dmin (n, K/256, 1) f16, the 6-bit sc and m (n, K/256, 8)
    and the nibbles u (n, K) in [0, 15]: weight = d * sc * u - dmin * m per 32 inputs."""
    sc, m = q4_k_scales(b[..., 4:16])
    u = nibble_halves(b[..., 16:].reshape(b.shape[0], -1, 4, 32)).reshape(b.shape[0], -1)
    return half(b[..., 0:2]), half(b[..., 2:4]), sc, m, u


def q4_k_linear(rows: Tensor, shape: tuple[int, int], bias: Tensor | None) -> Int4MinLinear:
    """Int4MinLinear (group 32) holding a Q4_K matrix's values; rows: (N, K / 256 * 144) uint8."""
    n, k = shape
    d, dmin, sc, m, u = q4_k_fields(super_blocks(rows, shape, 144))
    scale = (d.float() * sc.float()).reshape(n, -1)  # (N, K/32)
    minimum = (dmin.float() * m.float()).reshape(n, -1)  # (N, K/32)
    module = Int4MinLinear.from_values(u.to(torch.int16) - 8, scale, minimum, bias, Q4_K_GROUP)
    module.scale_parts = TwoLevel(sc.view(torch.int8).reshape(n, -1), d.reshape(n, -1), QK_K)
    module.minimum_parts = TwoLevel(m.view(torch.int8).reshape(n, -1), dmin.reshape(n, -1), QK_K)
    return module


# GGUF type -> (the loader of a projection stored in it, our scheme). Each keeps the file's numbers.
QUANTIZED_LINEARS = {
    "Q4_0": (q4_0_linear, "int4"),
    "Q8_0": (q8_0_linear, "int8"),
    "Q5_0": (q5_0_linear, "int8"),
    "Q6_K": (q6_k_linear, "int8"),
    "Q4_K": (q4_k_linear, "int4"),
}


class FileRows:
    """A quantized projection as its loader over blocks of the file's rows: ``values(rows)`` decodes
    those rows only (the portable module of them), and the rows' file pages leave the resident set
    once decoded, so a kernel twin filled from it (fast/quant_panels.py ``PanelLinear.fill``) is
    made a block of rows at a time. The twin's fill calls ``values`` over every block in order; the
    blocks' two-level scales (K-quants) are joined as they come, for its ``compact_scales``."""

    def __init__(self, load, raw: Tensor, shape: tuple[int, int], bias: Tensor | None) -> None:
        self.load, self.raw, self.bias = load, raw, bias
        self.out_features, self.in_features = shape
        self.sample = load(raw[:1], (1, shape[1]), None)  # one row: the module type and group
        self.group_size = self.sample.group_size
        self.parts: dict[str, dict[int, TwoLevel]] = {}
        self.whole: dict[str, TwoLevel] = {}  # joined parts, once every block was seen
        self.calls = 0
        self.mappings = file_mappings()  # read once: release_mapped would read them every block

    def values(self, rows: slice) -> tuple[Tensor, ...]:
        # The last blocks' temporaries, freed by now, go back to the kernel every TRIM_EVERY blocks:
        # glibc keeps freed blocks of a few MB in its heap, and a head's hundred blocks left ~170 MiB
        # there (1B, Q6_K); a trim every block made the load ~40% slower.
        self.calls += 1
        if self.calls % TRIM_EVERY == 0:
            trim()
        block = self.raw[rows]
        part = self.load(block, (block.shape[0], self.in_features), None)
        for name in ("scale_parts", "minimum_parts"):
            if getattr(part, name, None) is not None:
                self.parts.setdefault(name, {})[rows.start] = getattr(part, name)
        if block.is_contiguous():  # its own bytes (a strided block's would be the whole tensor's)
            release_mapped(block, self.mappings)
        return part.values(slice(None))

    def joined(self, name: str) -> TwoLevel | None:
        """The blocks' parts of ``name`` as one TwoLevel over every row (joined once), or None (none,
        or not every block seen)."""
        if name in self.whole:
            return self.whole[name]
        found = self.parts.get(name, {})
        blocks = [found[start] for start in sorted(found)]
        if not blocks or sum(b.sub.shape[0] for b in blocks) != self.out_features:
            return None
        subs, supers = torch.cat([b.sub for b in blocks]), torch.cat([b.super for b in blocks])
        self.whole[name] = TwoLevel(subs, supers, blocks[0].size)
        del self.parts[name]  # held once: the joined copy
        return self.whole[name]

    @property
    def scale_parts(self) -> TwoLevel | None:
        return self.joined("scale_parts")

    @property
    def minimum_parts(self) -> TwoLevel | None:
        return self.joined("minimum_parts")


def assembled(load, raw: Tensor, shape: tuple[int, int], bias: Tensor | None) -> QuantLinear:
    """``load``'s module of ``raw``'s rows (the file's bytes, mapped or copied), in the kernels'
    panels where they run it, made a block of rows at a time (FileRows): the whole portable module
    beside the panels, or the whole tensor's bytes beside either, held the largest tensor twice or
    three times at the load's peak (the 1B shape's tied head: +530 MiB). Without the kernels, the
    portable module of every row (a copy: the loaders never keep views of ``raw``)."""
    source = FileRows(load, raw, shape, bias)
    twin = fits(source.sample)
    module = twin(source) if twin is not None else load(raw, shape, bias)
    if raw.is_contiguous():  # the file's pages the portable module was read from
        release_mapped(raw, source.mappings)
    return module
