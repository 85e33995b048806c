"""Prefill and the one-token decode step for both generating shapes, over the static KV cache.

Legend: B batch, T prompt length, V vocabulary. Prefill runs the whole prompt (decoder) or the
encoder plus the decoder start token (encoder-decoder) in one forward and fills the cache; each
step then feeds one token per row at per-row positions (B, 1). Positions are tensors and the cache
has a fixed shape, so a compiled step sees the same shapes every token and compiles once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..fast import exported, native_step
from ..fast.compiled import compile_step, cpp_host, cpp_wrapper_setting
from ..fast.quant_panels import PanelLinear
from ..host_memory import trim
from ..nn.kv_cache import KVCache
from ..nn.rope_scaling import one_rule_length
from .request import Request


class Prefilled(NamedTuple):
    logits: Tensor  # (B, V) for the next token
    cache: KVCache
    next_pos: Tensor  # (B, 1) position of the next input token
    prefix: Tensor  # (B, T0): what the output starts with (the prompt, or the decoder start token)


def decoder_step(model, ids: Tensor, pos: Tensor, cache: KVCache) -> Tensor:
    """ids, pos (B, 1) -> logits (B, V), writing the tokens' keys/values at pos."""
    return model.logits(ids, pos, None, cache)[:, -1]


def chunk_step(model, ids: Tensor, pos: Tensor, cache: KVCache) -> Tensor:
    """ids, pos (B, T) -> logits (B, T, V) for every position (speculative verification)."""
    return model.logits(ids, pos, None, cache)


def seq2seq_step(model, ids: Tensor, pos: Tensor, cache: KVCache) -> Tensor:
    """Like decoder_step, attending to the cross K/V the cache was made with."""
    return model.logits(ids, pos, None, cache, cache.cross, cache.src_mask)[:, -1]


# A compiled step's graph is specialised to the cache's shape, so the cache length goes up in steps
# of CACHE_STEP positions (capped at max_seq_len): another prompt length or max_new_tokens in the
# same step reuses the graph instead of compiling again (~10-70 s). Eager decoding sizes it exactly.
CACHE_STEP = 256


def cache_length(needed: int, max_seq_len: int, bucketed: bool) -> int:
    """Positions the decoder cache holds: ``needed``, or with ``bucketed`` the next multiple of
    CACHE_STEP (never beyond max_seq_len, never below ``needed``)."""
    if not bucketed:
        return needed
    return max(needed, min(max_seq_len, -(-needed // CACHE_STEP) * CACHE_STEP))


# Rows (batch x prompt tokens) one prompt forward runs at a time on the CPU: a longer prompt goes
# through the cache in chunks of whole positions, each attending to the keys the ones before it
# wrote (what the decode step does one position at a time), so its activations stay those of
# PREFILL_ROWS rows, not of the prompt (an 8K-token prompt of the Llama-3.2-1B shape would hold
# ~400 MiB of MLP activations at once). Measured on the 1B shape (2 threads, one process, chunk
# sizes alternated, best of 3, ms for 1 x 512 / 8 x 64 tokens; 2026-12-06): bf16 whole 2880 / 2614,
# 256 rows 2735 / 2565, 128 rows 2938 / 2795; int4 g64 2266 / 2001, 2066 / 1934, 2089 / 1921; int8
# 2501 / 2361, 2153 / 1680, 2052 / 2167. Peak RSS of the bf16 8 x 64 prefill 2722 MiB whole, 2702
# in 256-row chunks. Other devices' products want more rows at once (their chunk is larger).
PREFILL_ROWS = {"cpu": 256}
PREFILL_ROWS_ELSEWHERE = 4096
# On a CPU with AMX tiles a model with quantized twins (fast/quant_panels.py ``prefill_bf16``) takes
# PANEL_CHUNKS chunks' rows at once: the int8 / int4 twins multiply a prefill in bf16 there, making
# each W^T once a chunk (the others, GGUF K-quant twins, were measured at 512 rows too). Measured on
# the 1B shape (an AMX Xeon, 2 threads, one process, a 512-token prompt's compiled first token,
# chunk sizes alternated, three rounds, ms, 256 / 512 rows; 2026-12-07): int8 1431 1419 / 1296 1260,
# int4 1406 1425 / 1212 1190; bf16 1048 1025 / 982 991, but the 512-row chunk's activations (its
# MLP's gate and up outputs: 16 MiB) put the bf16 worker's peak RSS past the 300 MB over weights +
# KV cache that issue 25 allows (the engines benchmark's bf16 worker replayed: 1 x 64 tokens + 48, 8
# x 64 + 48, the first token of 1 x 512, three rounds in one process; peak RSS beyond the weights
# and the KV cache, MiB, with the trim in ``prompt_hidden``: 512 rows 269 / 273 / 282, 256 rows 259 / 263
# / 264; 2026-12-07): bf16 (and fp32) models take 256.
PANEL_CHUNKS = 2


def chunk_rows(model, device: torch.device, needed: int | None = None) -> int:
    """Rows one prompt forward of ``model`` runs at a time on ``device`` (the comments above). The
    model is walked only where ``needed`` rows (the prompt's, None: any) exceed the narrow chunk."""
    rows = PREFILL_ROWS.get(device.type, PREFILL_ROWS_ELSEWHERE)
    if device.type != "cpu" or (needed is not None and needed <= rows):
        return rows
    wide = any(isinstance(m, PanelLinear) and m.prefill_bf16 for m in model.modules())
    return rows * PANEL_CHUNKS if wide else rows


def prompt_hidden(model, ids: Tensor, pos: Tensor, mask: Tensor | None, cache: KVCache) -> Tensor:
    """model.hidden over a prompt (B, T), writing every token's keys and values into ``cache``, in
    chunks of at most ``chunk_rows`` rows (at least one position each). -> the last position's (B, D).

    A RoPE table that picks its frequencies by the forward's length (dynamic NTK, LongRoPE: their
    ``relative_up_to``, the original length) rotates a prompt longer than that by the whole
    prompt's rule, as transformers does: such a prompt runs whole."""
    B, T = ids.shape
    step = max(1, chunk_rows(model, ids.device, B * T) // B)
    limit = one_rule_length(model) if step < T else None  # the model is walked only for a prompt to cut
    if limit is not None and limit < T:
        step = T
    for start in range(0, T, step):
        part = slice(start, start + step)
        out = model.hidden(ids[:, part], pos[:, part], None if mask is None else mask[:, part], cache)
    if ids.is_cpu:
        # The prompt's activations are freed, but glibc keeps their pages in the heap's free lists
        # (holes below live blocks are never given back), resident through the decode loop, which
        # needs few: given back here. Measured (the 1B shape in bf16, 512-row chunks, the replay of
        # PANEL_CHUNKS' comment; MiB by round): 284 / 297 / 297 without, 269 / 273 / 282 with; the
        # next prompt's first touch of those pages cost no time beyond the noise (512-token prompt
        # 0.96-1.05 s either way).
        trim()
    return out[:, -1]


def prefill(model, req: Request, batch_size: int | None = None, bucketed: bool = False) -> Prefilled:
    """Run the prompt once; the cache holds room for max_new_tokens more positions (more with
    ``bucketed``, for a compiled step: ``cache_length``).

    Left padding: each row's positions count only its real tokens, so a padded row sees exactly
    the positions (and RoPE angles, and cache slots) it would see alone; padding keys go to the
    cache's hidden slot.
    """
    ids, mask = req.input_ids, req.attention_mask
    if req.seq2seq:
        memory = model.encode(ids, src_mask=mask)
        cache = model.new_cache(ids.shape[0], req.max_new_tokens, memory=memory, src_mask=mask)
        start = torch.full((ids.shape[0], 1), req.start_token_id, dtype=ids.dtype, device=ids.device)
        pos = torch.zeros_like(start)
        return Prefilled(seq2seq_step(model, start, pos, cache), cache, pos + 1, start)
    # The last input token sits at position <= T + max_new - 2: the final new token is never fed.
    cache = model.new_cache(
        ids.shape[0], cache_length(ids.shape[1] + req.max_new_tokens - 1, model.config.max_seq_len, bucketed)
    )
    if mask is None:
        pos = torch.arange(ids.shape[1], device=ids.device)[None, :].expand(ids.shape[0], -1)  # (B, T)
    else:
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    # The head only for the last position: (B, V), not (B, T, V) logits nobody reads.
    logits = model.lm_head(prompt_hidden(model, ids, pos, mask, cache))
    return Prefilled(logits, cache, pos[:, -1:] + 1, ids)


_COMPILED: dict[tuple[str, bool], object] = {}


def step_function(seq2seq: bool, compiled: bool, fn=None, model=None):
    """The decode step; with ``compiled``, one torch.compile'd function per step kind and host code
    (``fast.compiled.cpp_host(model)``) with static shapes (dynamic=False): a new token changes no
    shape and no guard, so it never recompiles. ``fn`` picks another step kind (``chunk_step`` for
    speculative verification)."""
    fn = fn or (seq2seq_step if seq2seq else decoder_step)
    if not compiled:
        return fn
    key = (fn.__name__, cpp_host(model))
    if key not in _COMPILED:
        _COMPILED[key] = compile_step(fn, key[1])
    return _COMPILED[key]


def check_compile_settings(compiled: bool) -> None:
    """The environment's compile settings (TORCHFORMER_AOT_STEP, TORCHFORMER_CPP_WRAPPER,
    TORCHFORMER_NATIVE_STEP) read where a compiled call is validated, before any work; a wrong one
    raises ValueError naming it."""
    if compiled:
        exported.setting()
        cpp_wrapper_setting()
        native_step.enabled()


def loop_step(model, seq2seq: bool, compiled: bool, rows: int | None = None):
    """The step one decode loop calls: eager, or compiled. A compiled batch-1 step of a
    Llama-shaped bf16 decoder on the CPU is one native call (fast/native_step.py, ``rows`` 1); a
    decoder on the CPU (fast/exported.py ``ahead``) otherwise runs it compiled ahead by AOTInductor,
    with dynamo's step (``steady``) where that cannot be exported; encoder-decoders and other
    devices take dynamo's."""
    if compiled and not seq2seq and exported.ahead(model):
        compiled_ahead = lambda: exported.loop(  # noqa: E731 - built only where it runs
            decoder_step, lambda: steady(step_function(False, True, model=model), True)
        )
        return native_step.plan(model, rows, compiled_ahead) or compiled_ahead()
    return steady(step_function(seq2seq, compiled, model=model), compiled)


def steady(step, compiled: bool):
    """``step`` (compiled) for a decode loop over a few fixed shapes: the first call with each new
    set of tensor shapes evaluates dynamo's guards in full (and compiles if needed); the later calls
    evaluate only the guards that tell its cached graphs apart (``skip_guard_eval_unsafe``). The
    loop feeds the same model and cache every call, with only tensor values changing (and, in the
    server, one of a few row counts, each seen once in full first), so the full guards would pass
    each time; evaluating them was ~0.35 ms of a 4.7 ms compiled batch-1 step (profile). Not for
    loops whose non-tensor inputs change shape (a graph for a shape never seen would not be told
    apart)."""
    if not compiled:
        return step
    seen: set[tuple] = set()

    def call(*args):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        if shapes not in seen:
            seen.add(shapes)
            return step(*args)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return step(*args)

    return call
