"""Which fast twin a module gets on this CPU, and the swap: quantized linears become their panel
twins (fast/quant_panels.py, the integer kernels), bf16 ``Linear``s become ``Bf16Linear`` (the bf16
kernel over the module's own weight). The layout belongs to the CPU that runs it, so it is made at
run time and never saved: ``tfm.quantize`` and ``tfm.load`` call ``prepare``; it does nothing where
the kernels are not built (neither AVX-512 nor AVX2, no compiler, ``TORCHFORMER_NATIVE=0``), on other devices, or
for shapes the kernels do not take (K not a multiple of 4 for int8, a group not a multiple of 8 for
int4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..host_memory import file_mappings, in_file_mapping
from ..host_memory import release_mapped as release_mapped_pages
from ..nn.linear import Linear, cpu_bf16_units
from ..nn.quant import Int4Linear, Int8Linear, QuantLinear
from ..nn.quant_min import Int4MinLinear
from .int4_panels import Int4MinPanels, Int4Panels
from .joint import join
from .panels import huge_arena
from .quant_panels import Int8Panels, PanelLinear, finished, ops_ready, rows_of

# From this many rows (a prefill) the kernel, which re-reads its x rows per weight tile, loses to
# MKL's fp32 product over WIDEN_SLICE weight rows widened at a time (bounded scratch, never the
# whole matrix). Measured over 2 layers of the Llama-3.2-1B shape, 2 threads: 16 rows: kernel
# 45 GFLOP/s, slices 26; 64 rows: 42 vs 59; 512 rows: 40 vs 125.
WIDEN_ROWS, WIDEN_SLICE = 48, 256

# On a CPU with bf16 dot-product units (AVX512-BF16 or AMX) a bf16 model's activations are already
# bf16, and oneDNN's bf16 product (F.linear) multiplies them natively: from UNIT_ROWS rows it beats
# both the kernel over fp32 x and the widened slices. Measured (benchmarks.formats: 4 layers of the
# 1B shape, 2 threads, an AVX512-BF16 EPYC, ms, kernel or widened slices vs F.linear): 1 row 17.1 vs
# 30.7, 2: 18.7 vs 24.7, 4: 24.7 vs 33.4, 5: 37.2 vs 26.9, 8: 55.6-58.9 vs 30.9-32.9, 64: 214 vs 92,
# 256: 711 vs 296. Without those units torch converts at every call: never taken. Decided once.
BF16_UNITS = cpu_bf16_units()
UNIT_ROWS = 5
# Where the CPU has AVX512-BF16 itself, bf16 activations of fewer than DOT_ROWS rows take the
# kernel's `vdpbf16ps` product instead (csrc/bf16.cpp ``bf16_dot``: x as it comes, one instruction
# per 64-byte weight line and row), ahead of both. Measured over the 1B shape's 113 matrices (2
# threads, the same EPYC, best of 4, ms, bf16_dot / bf16_linear over fp32 x / F.linear): 1 row
# 73.9 / 74.0 / 149, 2: 71.2 / 80.7 / 146, 4: 81.3 / 118 / 154, 8: 112 / 284 / 182, 12: 172 / 366
# / 203, 16: 224 / 505 / 223; one row against a plain streaming read of the same bytes: 34.0 GB/s
# against bf16_linear's 32.2 (the read 35.9). AMX without AVX512-BF16 (and so any AVX2 CPU): not taken.
DOT_UNITS = torch.cpu._is_avx512_bf16_supported()
DOT_ROWS = 16
STREAM_CHUNK = 32 << 20  # bytes of a mapped bf16 weight copied into huge pages at a time (stream_mapped_bf16)


def widened_product(x2: Tensor, w: Tensor) -> Tensor:
    """x2 (rows, K) fp32 @ w (N, K)^T for a 16-bit w: each slice of rows of w widened to fp32
    then multiplied by MKL (rows, N)."""
    out_t = x2.new_empty((w.shape[0], x2.shape[0]))  # (N, rows): each slice's result is contiguous
    for start in range(0, w.shape[0], WIDEN_SLICE):
        part = w[start : start + WIDEN_SLICE].float()  # (slice, K)
        torch.mm(part, x2.t(), out=out_t[start : start + WIDEN_SLICE])
    return out_t.t()  # (rows, N)


class Bf16Linear(Linear):
    """A bf16 ``Linear`` whose inference products on the CPU run the kernel over its own weight
    (csrc/bf16.cpp ``bf16_linear``: no copy, no packing, the same Parameters and state dict).
    torch's bf16 products on a CPU without bf16 units convert at every call (measured 1 / 8 / 64
    rows over 4 layers of the Llama-3.2-1B shape: see benchmarks/RESULTS.md); on a CPU with bf16
    units, bf16 activations take the kernel's vdpbf16ps product below DOT_ROWS rows where the CPU
    has AVX512-BF16, and oneDNN's bf16 product from there (from UNIT_ROWS rows without it).
    Training, autograd, other dtypes and devices take ``Linear``'s path."""

    @classmethod
    def of(cls, source: Linear) -> Bf16Linear:
        twin = cls.__new__(cls)
        twin.__dict__.update(source.__dict__)  # the same Parameters, hooks and flags, not copies
        return twin

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w.dtype != torch.bfloat16 or not (x.is_cpu and w.is_cpu) or self.grad_needed(x):
            return super().forward(x)
        rows = x.numel() // max(1, x.shape[-1])
        if BF16_UNITS and x.dtype == torch.bfloat16:  # the CPU's bf16 units (module top)
            if DOT_UNITS and rows < DOT_ROWS:  # vdpbf16ps over x as it comes
                out = torch.ops.torchformer.bf16_dot(x.reshape(rows, -1).contiguous(), w.contiguous())  # (rows, N)
                return self.finish(out, x)
            if rows >= UNIT_ROWS:
                return F.linear(x, w, self.bias)  # oneDNN's bf16 product
        x2 = rows_of(x)  # (rows, K) fp32
        if rows < WIDEN_ROWS:
            out = torch.ops.torchformer.bf16_linear(x2, w.contiguous())  # (rows, N)
        else:
            out = widened_product(x2, w)
        return self.finish(out, x)

    def finish(self, out: Tensor, x: Tensor) -> Tensor:
        return finished(out, x, self.bias, self.out_features)

    def grad_needed(self, x: Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)


def fits(module: nn.Module) -> type[nn.Module] | None:
    """The kernels' twin for ``module``, or None where the kernels cannot run it."""
    if type(module) is Linear and module.weight.dtype == torch.bfloat16 and module.weight.is_cpu:
        return Bf16Linear if ops_ready() else None
    if type(module) in (Int8Linear, Int4Linear, Int4MinLinear):
        return panel_twin(type(module), module.in_features, getattr(module, "group_size", None), module.qweight)
    return None


def panel_twin(scheme: type[QuantLinear], k: int, group_size: int | None, like: Tensor) -> type[PanelLinear] | None:
    """The panel twin of ``scheme`` for K = k inputs, where the kernels run it for a weight on
    ``like``'s device (int8: K and any group a multiple of 4; int4: a group a multiple of 8)."""
    fit = scheme is Int8Linear and k % 4 == 0 and (group_size or k) % 4 == 0
    fit = fit or scheme in (Int4Linear, Int4MinLinear) and group_size % 8 == 0
    twin = {Int8Linear: Int8Panels, Int4Linear: Int4Panels, Int4MinLinear: Int4MinPanels}.get(scheme)
    return twin if fit and like.is_cpu and ops_ready() else None


def quantizer(scheme: type[QuantLinear]):
    """``scheme.from_linear``, or its panel twin's where the kernels run it: a quantizing load
    writes the panels directly, never the portable copy first."""

    def make(lin: nn.Linear, group_size: int | None, on_block=None) -> QuantLinear:
        twin = panel_twin(scheme, lin.in_features, group_size, lin.weight)
        return (twin or scheme).from_linear(lin, group_size, on_block=on_block)

    return make


def prepared(module: nn.Module, release_mapped: bool = False) -> nn.Module:
    """``module``'s kernel twin where ``fits`` finds one, else ``module`` itself. release_mapped (a
    loader's, for a module it has just read from a memory-mapped file): a panel twin's source
    bytes give their pages back (``host_memory.release_mapped``); the twin holds its own copy."""
    twin = fits(module)
    if twin is None:
        return module
    out = twin.of(module)
    if release_mapped and isinstance(out, PanelLinear):
        release_mapped_pages(module.qweight)
    return out


def stream_mapped_bf16(model: nn.Module) -> int:
    """Move the ``Bf16Linear`` weights that lie in a file's mapping (a loader's safetensors) into one
    arena of huge pages (fast/panels.py ``huge_arena``: a batch-1 step reads them whole, and the plain
    read of huge pages is 1.16x that of the mapping's 4 KiB pages here; one arena, so a small model's
    weights of under 2 MiB each get them too), STREAM_CHUNK bytes at a time, each chunk's mapped
    pages given back once copied: the process holds one copy and at most a chunk twice (the 1B
    shape's tied table whole: +440 MiB of peak). The same Parameters, their values unchanged (a tied
    table's embedding reads the copy too); a weight already in memory stays where it is. Returns the
    bytes moved."""
    candidates = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Bf16Linear)}  # tied: once
    candidates = [w for w in candidates.values() if w.dtype == torch.bfloat16 and w.is_cpu and w.is_contiguous()]
    mappings = file_mappings() if candidates else []  # read once, and only for a model with bf16 twins
    found = [w for w in candidates if in_file_mapping(w, mappings)]
    moved = 0
    for inference in (False, True):
        group = [w for w in found if w.is_inference() == inference]
        if group:
            moved += move_into_arena(group, inference, mappings)
    return moved


def move_into_arena(weights: list[Tensor], inference: bool, mappings) -> int:
    """``stream_mapped_bf16``'s move of ``weights``, all of them normal or all inference tensors
    (a model the serving engine loaded under inference_mode): the copies are made as the weights
    were, whatever mode the caller runs in (a decode loop's inference_mode), since an inference
    Parameter given normal data fails in its next op (the tied table's embedding: "Inference
    tensors do not track version counter"). Returns the bytes moved (0: no huge pages here)."""
    with torch.inference_mode(inference), torch.no_grad():
        arena = huge_arena([(tuple(w.shape), w.dtype) for w in weights])
        for w, new in zip(weights, arena or []):
            old = w.data
            row_bytes = old.numel() // max(1, old.shape[0]) * old.element_size()
            step = max(1, STREAM_CHUNK // max(1, row_bytes))  # rows a chunk
            for row in range(0, old.shape[0], step):
                new[row : row + step].copy_(old[row : row + step])
                release_mapped_pages(old[row : row + step], mappings)
            w.data = new
    return sum(w.numel() * w.element_size() for w in weights) if arena else 0


def prepare(model: nn.Module, release_mapped: bool = False) -> int:
    """Swap ``model``'s quantized linears for their panel twins and its bf16 ``Linear``s for
    ``Bf16Linear`` where the kernels run (``prepared``, one module at a time, so a panel copy
    never waits for the others), moves the bf16 weights a loader mapped into huge pages
    (``stream_mapped_bf16``), then joins the panel twins of each attention's q/k/v and each gated
    MLP's gate/up (fast/joint.py, again where a load or cast since left a joint stale); returns how
    many were swapped (module docstring). Idempotent; a no-op without the kernels."""
    names = [name for name, m in model.named_modules() if fits(m) is not None]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, prepared(getattr(owner, leaf), release_mapped))
    stream_mapped_bf16(model)  # mapped bf16 weights into huge pages
    join(model)  # q/k/v and gate/up panel twins as one product each (fast/joint.py)
    return len(names)
