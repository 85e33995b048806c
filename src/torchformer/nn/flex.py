"""The ``flex`` backend: FlexAttention (torch.nn.attention.flex_attention) with the patterns'
rules as its mask_mod and score_mod, so ALiBi, T5 buckets, windows, padding and documents are
applied inside the kernel and no (B, H, T, S) tensor is ever materialised.

Same semantics as the other backends: rows with no visible key give zeros, GQA shares K/V heads
(``enable_gqa``), soft-capping and the scale are honoured. Dropout on the weights has no
in-kernel form in FlexAttention, so a training forward with attention dropout runs the math
reference on the dense pattern instead (exact, not O(T)).

torch 2.13 has no FlexAttention backward on CPU (nor a compiled CPU kernel that returns the
log-sum-exp): on CPU the forward runs the compiled kernel and the backward is
``flex_grad.tiled_backward``, the FlashAttention-2 backward over the query tiles and key blocks
the block mask says are visible, O(T) memory. On CUDA FlexAttention's own backward runs.

On CPU the kernel runs on lengths padded to whole 128-blocks (the padded keys masked out, the
padded queries' rows dropped): torch 2.13's compiled CPU kernel gave wrong rows, even NaN, for some
lengths below a block on a CPU without AVX-512 (measured on an AVX2 EPYC: causal B=3, T=S=40, the
last batch row off by 1.8; T=300, S=40 off by 0.75; T=S=127 or 168 right). A block holds its tail
either way, so padding adds no block to visit.

Legend: B batch, H query heads, K kv heads, T queries, S keys, E head dim.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .backends import dense_fallback
from .flex_grad import tiled_backward
from .patterns import Pattern, Rule, from_dense

BLOCK = 128  # FlexAttention's default sparse block size (queries and keys)
_STATE = {"compiled": True}
WHOLE_BLOCKS = frozenset({"cpu"})  # device types whose kernel runs on lengths padded to blocks (docstring)


def _triton_reason() -> str | None:
    from torch.utils._triton import has_triton

    return None if has_triton() else "Triton is not installed (flex compiles to Triton on CUDA)"


def _cpp_reason() -> str | None:
    if any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return None
    return "no C++ compiler found (inductor compiles flex to C++ on CPU)"


COMPILER_CHECKS = {"cuda": _triton_reason}  # device type -> check; others compile to C++


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why flex cannot run here (None when it can): no FlexAttention in this torch, or no
    compiler for inductor (a C++ compiler on CPU, Triton on CUDA)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as err:
        return f"this torch ({torch.__version__}) has no torch.nn.attention.flex_attention ({err})"
    return COMPILER_CHECKS.get(torch.device(device).type, _cpp_reason)()


@contextlib.contextmanager
def eager():
    """Run the FlexAttention kernel uncompiled inside the block (tests of semantics: the eager
    kernel materialises scores but needs no compile per new shape)."""
    before = _STATE["compiled"]
    _STATE["compiled"] = False
    try:
        yield
    finally:
        _STATE["compiled"] = before


RECOMPILE_LIMIT = 64  # shapes per process: dynamo's default (8) would silently fall back to eager


@functools.cache
def _compiled_kernel():
    # dynamic=False: one specialised kernel per shape (and pattern); generation keeps shapes
    # static. Past dynamo's recompile limit the call would run the eager kernel, which
    # materialises the scores: raise the limit (a process-wide dynamo setting) instead.
    from torch._dynamo import config as dynamo_settings
    from torch.nn.attention.flex_attention import flex_attention

    dynamo_settings.recompile_limit = max(dynamo_settings.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False)


def kernel(*args, **kwargs):
    """flex_attention, compiled (the default) or eager (inside ``eager()``)."""
    if _STATE["compiled"]:
        return _compiled_kernel()(*args, **kwargs)
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(*args, **kwargs)


@dataclass
class FlexBlocks:
    """The BlockMask for one pattern plus which (query block, key block) tiles hold any visible
    key for some row (nQ, nK), which the tiled backward reads as lists (``spans``): only there,
    outside any compiled region, since the lists depend on tensor values."""

    block_mask: object
    visible: Tensor

    @property
    def spans(self) -> list[list[int]]:
        return [row.nonzero().flatten().tolist() for row in self.visible]


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """(B, 1, nQ, nK) bool -> (count (B, 1, nQ), indices (B, 1, nQ, nK)) with the True ones first."""
    count = dense.sum(-1, dtype=torch.int32)
    order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, order


def build_blocks(pattern: Pattern) -> FlexBlocks:
    """Evaluate the mask rule one query block at a time ((B, 128, S) bools, never (B, T, S)) and
    classify each 128 x 128 tile as empty, partial or full (full tiles skip the mask_mod)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, T, S, dev = pattern.B, pattern.T, pattern.S, pattern.device
    nQ, nK = -(-T // BLOCK), -(-S // BLOCK)
    b = torch.arange(B, device=dev).view(B, 1, 1)
    h = torch.zeros(1, 1, 1, dtype=torch.long, device=dev)
    kv = torch.arange(nK * BLOCK, device=dev).view(1, 1, -1)
    inside = kv < S
    partial, full = [], []
    for i in range(nQ):
        q = torch.arange(i * BLOCK, min(T, (i + 1) * BLOCK), device=dev).view(1, -1, 1)
        m = inside if pattern.mask is None else pattern.mask(b, h, q, kv.clamp(max=S - 1)) & inside
        tiles = m.expand(B, q.shape[1], -1).unflatten(-1, (nK, BLOCK))  # (B, bq, nK, 128)
        some, every = tiles.any(-1).any(1), tiles.all(-1).all(1)  # (B, nK) each
        partial.append(some & ~every)
        full.append(every)
    partial_t, full_t = torch.stack(partial, 1)[:, None], torch.stack(full, 1)[:, None]  # (B, 1, nQ, nK)
    padded = (nQ * BLOCK, nK * BLOCK) if dev.type in WHOLE_BLOCKS else (T, S)
    mask_mod = pattern.mask if pattern.mask is not None else (lambda b, h, q, kv: q >= 0)
    if padded != (T, S):  # the rule reads real positions only; a padded key is never visible
        rule = mask_mod
        mask_mod = lambda b, h, q, kv: (kv < S) & rule(b, h, q.clamp(max=T - 1), kv.clamp(max=S - 1))  # noqa: E731
    block_mask = BlockMask.from_kv_blocks(
        *_ordered(partial_t), *_ordered(full_t), BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=padded
    )
    return FlexBlocks(block_mask, (partial_t | full_t).any(0)[0])  # visible: (nQ, nK)


def score_mod(bias: Rule | None, softcap: float | None):
    """score -> cap * tanh(score / cap) (Gemma 2), then + bias(b, h, q, kv); None if neither."""
    if bias is None and softcap is None:
        return None
    if softcap is None:
        return lambda s, b, h, q, kv: s + bias(b, h, q, kv)
    if bias is None:
        return lambda s, b, h, q, kv: softcap * torch.tanh(s / softcap)
    return lambda s, b, h, q, kv: softcap * torch.tanh(s / softcap) + bias(b, h, q, kv)


def run(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, blocks: FlexBlocks, scale: float, softcap: float | None):
    """The kernel over ``blocks``: on lengths padded to the block mask's (CPU, module docstring),
    the bias read at real positions only, the padded queries' rows dropped. (B, H, T, E)."""
    (T, S), (Tp, Sp) = (q.shape[2], k.shape[2]), blocks.block_mask.seq_lengths
    bias = pattern.bias
    if (Tp, Sp) != (T, S):
        q, k, v = F.pad(q, (0, 0, 0, Tp - T)), F.pad(k, (0, 0, 0, Sp - S)), F.pad(v, (0, 0, 0, Sp - S))
        if bias is not None:
            real = bias
            bias = lambda b, h, qi, kv: real(b, h, qi.clamp(max=T - 1), kv.clamp(max=S - 1))  # noqa: E731
    out = kernel(q, k, v, score_mod=score_mod(bias, softcap), block_mask=blocks.block_mask, scale=scale,
                 enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip
    return out if Tp == T else out[:, :, :T].contiguous()


class _FlexFunction(torch.autograd.Function):
    """Compiled flex forward, tiled FlashAttention-2 backward (flex_grad.py)."""

    @staticmethod
    def forward(ctx, q, k, v, pattern, blocks, scale, softcap, *params):
        with torch.no_grad():  # the kernel refuses inputs that require grad on CPU
            out = run(q.detach(), k.detach(), v.detach(), pattern, blocks, scale, softcap)
        ctx.save_for_backward(q, k, v, out)
        ctx.args = (pattern, blocks, scale, softcap, len(params))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors
        pattern, blocks, scale, softcap, n_params = ctx.args
        dq, dk, dv, dparams = tiled_backward(q, k, v, out, dout, pattern, blocks.spans, BLOCK, scale, softcap)
        return dq, dk, dv, None, None, None, None, *dparams[:n_params]


def flex_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    scale: float,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    pattern: Pattern | None = None,
) -> Tensor:
    """The backends' signature. The stack's ``pattern`` (rules + a prebuilt block mask) is what
    flex uses; dense mask/bias/is_causal are accepted for direct calls and wrapped as rules."""
    if pattern is None or mask is not None or bias is not None:
        pattern = from_dense(q, k, mask, bias, is_causal)
    # Dropout: FlexAttention has none in-kernel. Inside an outer torch.compile (the compiled decode
    # step), torch 2.13's CPU flex template fails to lower ("not enough values to unpack"); the
    # dense form is exact and, for the few query rows of a decode step, small.
    if dropout_p > 0.0 or (q.is_cpu and torch.compiler.is_compiling()):
        return dense_fallback(q, k, v, pattern, scale=scale, dropout_p=dropout_p, softcap=softcap)
    blocks = pattern.blocks if pattern.blocks is not None else build_blocks(pattern)
    params = tuple(p for p in pattern.params if p.requires_grad)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or params):
        if not q.is_cpu:  # CUDA: FlexAttention's own (Triton) backward; not run in this repo's CI
            return run(q, k, v, pattern, blocks, scale, softcap)
        return _FlexFunction.apply(q, k, v, pattern, blocks, scale, softcap, *params)
    with torch.no_grad():  # nothing needs a gradient: one compiled variant, as in the training forward
        return run(q, k, v, pattern, blocks, scale, softcap)
