"""A batch-1 decode step of a Llama-shaped bf16 decoder as one native call (csrc/step.cpp): the whole
forward in one parallel region of the CPU kernels' threads, instead of a compiled graph that opens a
region per product and calls each product, attention and glue kernel through the dispatcher.

Measured at the toy shape (6 layers, hidden 512, int4 g64, 2 threads, the Intel Xeon of fast-paths.md;
perf over the decode loop only): a compiled step took ~0.49 ms and the loop ~0.63 ms a token, of
which the 25 products took ~0.30 (called back to back through the dispatcher); the second thread
spun 62% of the time, and the first spent ~40% outside the kernels (the dispatcher, allocations,
the graph's glue kernels, the Python loop). With this step ~0.30-0.33 ms a token (int8 0.86 ->
0.51-0.56 ms, bf16 1.22 -> 0.94-0.98); at the 1B shape int4 36.4 -> 40.8 tok/s, 82% -> 90% of the
streaming bound (benchmarks/RESULTS.md, the engines tables).

Taken (``plan``) where every part of the model is one the native step computes exactly as the
model does: a ``DecoderLM`` on the CPU in bf16, pre-norm blocks of ``RMSNorm`` -> attention with
rotate-half RoPE over the whole head, no QK-norm, soft-capping, window, score bias or layer kinds ->
a SiLU-gated MLP, no post-norms; an unscaled token table without absolute positions; the q/k/v and
gate/up projections joined (fast/joint.py) and every projection a ``Bf16Linear`` on AVX512-BF16 or
interleaved int8 / int4 panels with one-level scales (fast/quant_panels.py). Anything else keeps the
compiled step (``plan`` returns None and says why at debug level). ``TORCHFORMER_NATIVE_STEP=0``
turns it off.

Numerics: the eager model's bf16 rounding points and the same product kernels (csrc/step.cpp); sums
in another order (the norms' means, the attention's scores on the bf16 units), so greedy tokens
equal the eager model's and logits agree to bf16's rounding, not always bit for bit
(tests/fast/test_native_step.py).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..nn.attention import Attention
from ..nn.block import pre_norm
from ..nn.mlp import GatedMLP, silu_times
from ..nn.norms import RMSNorm
from ..nn.positions import RotaryTable, rotate_half
from .bf16 import DOT_UNITS, Bf16Linear
from .bf16_joint import Bf16Joint
from .int4_panels import Int4Panels
from .int8_panels import Int8Panels
from .joint import PanelJoint, base_class
from .native import kernels

log = logging.getLogger(__name__)

EMPTY = torch.empty(0)


def enabled() -> bool:
    """TORCHFORMER_NATIVE_STEP: "1" (default) takes the native step where ``plan`` finds one, "0" never."""
    value = os.environ.get("TORCHFORMER_NATIVE_STEP", "1")
    if value not in ("0", "1"):
        raise ValueError(f"TORCHFORMER_NATIVE_STEP must be 0 or 1, got {value!r}")
    return value == "1"


class Unsupported(Exception):
    """What the native step does not compute (its message says which part)."""


def bf16_projection(w: Tensor, bias: Tensor | None) -> tuple[list[Tensor], list[int]]:
    """(tensors, ints) of a bf16 weight (N, K) for csrc/step.cpp (``bf16_row``: AVX512-BF16)."""
    if not DOT_UNITS or w.dtype != torch.bfloat16 or not w.is_contiguous():
        raise Unsupported("a bf16 projection needs AVX512-BF16 and a contiguous bf16 weight")
    return [w, EMPTY, EMPTY if bias is None else bias.float().contiguous()], [16, w.shape[0], w.shape[1], 0, 1]


def projection(module: nn.Module, bias: Tensor | None = None) -> tuple[list[Tensor], list[int]]:
    """(tensors, ints) of one projection for csrc/step.cpp: a ``Bf16Linear`` or interleaved int8 / int4
    panels with one-level scales (exact classes: a subclass or a wrapper computes otherwise); ``bias``
    in place of the module's own (a joint's members' biases end to end)."""
    if bias is None:
        bias = module.bias
    if type(module) is Bf16Linear:
        return bf16_projection(module.weight, bias)
    if type(module) not in (Int4Panels, Int8Panels):
        raise Unsupported(f"a projection of type {type(module).__name__}")
    if module.ways <= 1 or module.super_scale is not None:
        raise Unsupported("panels must be interleaved with one-level scales")
    bits = 4 if type(module) is Int4Panels else 8
    group = module.group_size or module.in_features  # None: one scale per row
    b = EMPTY if bias is None else bias.float().contiguous()
    return [module.panels, module.scale, b], [bits, module.out_features, module.in_features, group, module.ways]


def joint_projection(owner: nn.Module, names: tuple[str, ...]) -> tuple[list[Tensor], list[int]]:
    """The owner's joint product (fast/joint.py) with its members' biases end to end."""
    joint = getattr(owner, "joint", None)
    if not isinstance(joint, (PanelJoint, Bf16Joint)) or not joint.current(owner):
        raise Unsupported(f"{type(owner).__name__}'s {names} are not joined")
    members = [getattr(owner, n) for n in names]
    bias = None
    if any(m.bias is not None for m in members):
        bias = torch.cat([torch.zeros(m.out_features) if m.bias is None else m.bias.float() for m in members])
    if isinstance(joint, Bf16Joint):
        return bf16_projection(joint.fused.weight, bias)
    return projection(joint.fused, bias)  # the fused twin has no bias of its own: the members' or none


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Unsupported(what)


def layer_parts(block: nn.Module, first: Attention) -> tuple[list[Tensor], list[int], list[float]]:
    attn, mlp = block.attn, block.mlp
    children = {n: type(c) for n, c in block.named_children()}
    check(block.residual is pre_norm, "a block that is not pre-norm")
    check(
        set(children) == {"attn", "attn_norm", "mlp", "mlp_norm", "drop", "attn_out_norm", "mlp_out_norm"},
        f"a block with parts {sorted(children)}",
    )
    check(not dict(block.named_parameters(recurse=False)), "a block with parameters of its own (layer scales)")
    for n in ("drop", "attn_out_norm", "mlp_out_norm"):
        check(children[n] is nn.Identity, f"a block's {n} of type {children[n].__name__}")
    for n in ("attn_norm", "mlp_norm"):
        check(children[n] is RMSNorm, f"a {children[n].__name__} norm")
    # exact classes (or their joint twins): a subclass computes its projections otherwise
    check(base_class(attn) is Attention, f"attention of type {type(attn).__name__}")
    check(type(attn.q_norm) is nn.Identity and type(attn.k_norm) is nn.Identity, "QK-norm")
    check(
        attn.rotate is rotate_half and attn.softcap is None and attn.head_dim <= 128,
        "another RoPE layout or soft-capping",
    )
    check(
        (attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.scale)
        == (first.n_heads, first.n_kv_heads, first.head_dim, first.scale),
        "layers of different attention shapes",
    )
    check(base_class(mlp) is GatedMLP and mlp.glu is silu_times, "an MLP that is not SiLU-gated")
    qkv, qkv_i = joint_projection(attn, ("q_proj", "k_proj", "v_proj"))
    o, o_i = projection(attn.o_proj)
    gu, gu_i = joint_projection(mlp, ("gate", "up"))
    down, down_i = projection(mlp.down)
    norms = [block.attn_norm.weight, block.mlp_norm.weight]
    check(all(w.dtype == torch.bfloat16 for w in norms), "norm weights not in bf16")
    return norms + qkv + o + gu + down, qkv_i + o_i + gu_i + down_i, [block.attn_norm.eps, block.mlp_norm.eps]


def parts(model: nn.Module) -> tuple[list[Tensor], list[int], list[float]]:
    """csrc/step.cpp's DecoderStep arguments for ``model``, or Unsupported naming what it lacks."""
    # a decoder-only LM (models/decoder.py DecoderLM, a floor above fast/): its parts by name
    check(all(hasattr(model, n) for n in ("embed", "stack", "lm_head")), f"a {type(model).__name__}")
    stack, embed = model.stack, model.embed
    check(type(embed.tok) is nn.Embedding, f"a token table of type {type(embed.tok).__name__}")  # a GGUF file's
    tok = embed.tok.weight
    check(tok.dtype == torch.bfloat16 and tok.is_cpu, "a model not in bf16 on the CPU")
    check(
        embed.scale == 1.0 and embed.absolute is None and embed.token_types is None and embed.norm is None,
        "a scaled token table or absolute positions",
    )
    check(type(embed.drop) is nn.Identity, "embedding dropout")
    # hooks run in a module's forward, which the native step never calls (checked after the cheap
    # checks: an fp32 model never walks its modules here)
    hooked = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    check(
        not hooked and not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks,
        "forward hooks",
    )
    check(
        isinstance(stack.rope, RotaryTable)
        and len(stack.kinds) == 0
        and stack.window is None
        and stack.score_bias is None
        and stack.causal,
        "positions other than one RoPE table, windows or layer kinds",
    )
    check(
        type(stack.final_norm) is RMSNorm and stack.final_norm.weight.dtype == torch.bfloat16,
        "a final norm other than RMSNorm",
    )
    first = stack.blocks[0].attn
    check(tok.is_contiguous(), "a strided token table")  # never copied: the 1B shape's is 525 MB
    tensors, ints, floats = [tok, stack.final_norm.weight], [], [first.scale, stack.final_norm.eps]
    for block in stack.blocks:
        t, i, f = layer_parts(block, first)
        tensors += t
        ints += i
        floats += f
    head, head_i = projection(model.lm_head)
    D, V = tok.shape[1], tok.shape[0]
    mlp = stack.blocks[0].mlp
    shape = [D, first.n_heads, first.n_kv_heads, first.head_dim, mlp.down.in_features, V, len(stack.blocks)]
    return tensors + head, shape + ints + head_i, floats


class NativeStep:
    """The native step bound to one model, called as a decode loop's step ``(model, ids, pos, cache)
    -> logits (1, V)`` (fp32 holding bf16 values); the cache is bound at its first call. A cache
    the step cannot take (another layout) sends the loop to ``fallback()``'s step instead."""

    def __init__(self, model: nn.Module, module, fallback) -> None:
        tensors, ints, floats = parts(model)
        try:
            self.step = module.DecoderStep(tensors, ints, floats)
        except RuntimeError as err:  # the tensors' own checks (csrc/step.cpp): a shape this module did not see
            raise Unsupported(str(err).splitlines()[0]) from err
        self.rope = model.stack.rope
        self.fallback = fallback
        self.cache, self.other = None, None

    def bind(self, cache) -> bool:
        kv = [t for layer in cache.layers for t in (layer.k, layer.v)]
        cos, sin = self.rope(torch.arange(kv[0].shape[2])[None])  # (1, 1, S, E/2) each
        try:
            self.step.set_cache(kv, cos[0, 0].contiguous(), sin[0, 0].contiguous())
        except RuntimeError as err:
            log.debug("torchformer: the native decode step does not take this cache (%s)", err)
            return False
        self.cache = cache
        return True

    def __call__(self, model: nn.Module, ids: Tensor, pos: Tensor, cache) -> Tensor:
        if self.other is None and cache is not self.cache and not self.bind(cache):
            self.other = self.fallback()
        if self.other is not None:
            return self.other(model, ids, pos, cache)
        return self.step.run(int(ids), int(pos))

    def greedy(self, logits: Tensor, pos: Tensor, n: int, stop: set[int], scores: bool = False) -> Iterator:
        """Up to n greedy tokens (1,) from the prompt's logits (1, V) and the next position (1, 1),
        ending after a token in ``stop`` (EOS ids), as generation.generate's loop gives them for one
        row; with ``scores`` (token, logits (1, V)) pairs. After the first, each is one call into
        csrc/step.cpp's loop (``Greedy``, a plain CPython iterator: csrc/py_iter.h), which chooses
        the token with the logits, so no Python frame and no torch op run between two steps (at the
        toy shape a generator and the ops between steps cost ~20 us a token: the step's weight
        stream had evicted all they touch)."""
        tok = logits.argmax(-1)  # (1,): the first index of the maximum, as the step's own
        rest = (self.step.greedy_scores if scores else self.step.greedy)(int(tok), int(pos), n - 1, sorted(stop))
        return itertools.chain(((tok, logits) if scores else tok,), rest)


def takes(step, cache) -> bool:
    """Whether ``step`` is a native step that decodes over ``cache`` (bound to it here)."""
    return isinstance(step, NativeStep) and step.other is None and (cache is step.cache or step.bind(cache))


def plan(model: nn.Module, rows: int | None, fallback) -> NativeStep | None:
    """The native step for ``model`` decoding ``rows`` rows, or None (module docstring); its loop
    takes ``fallback()``'s step where the cache does not fit."""
    if rows != 1 or not enabled():
        return None
    module = kernels()
    if module is None or not hasattr(module, "DecoderStep"):
        return None
    try:
        return NativeStep(model, module, fallback)
    except (Unsupported, AttributeError) as err:  # AttributeError: a part of another shape than checked
        log.debug("torchformer: the native decode step does not take this model (%s)", err)
        return None
