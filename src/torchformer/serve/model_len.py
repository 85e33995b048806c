"""max-model-len: the positions a request may use (prompt + new tokens), which size the KV cache.

The engine preallocates ``slots`` rows of that many positions (DESIGN section 4), so the length
is what memory allows, not only what the model was trained for: a Llama-3.2-1B-shaped folder
(max_position_embeddings 131072) would ask for 8 x 131072 positions, ~34 GB in bf16. As vLLM
does, the default is the largest length whose cache fits, capped at the model's max_seq_len, and
the server says what it chose and why in one start-up line; an explicit length is checked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..analysis.accounting import kv_cache_bytes
from ..configs import ModelConfig
from ..host_memory import available_bytes
from ..models.decoder import DecoderLM

log = logging.getLogger(__name__)

# A default cache takes at most half the free memory: the rest is for activations, logits, the
# allocator's slack and everyone else on the machine. A length the user asks for may take more.
DEFAULT_SHARE, EXPLICIT_SHARE = 0.5, 0.9
STEP = 256  # a default below the model's length is rounded down to a multiple of this (readable)
OPTION = "--max-model-len"
REMEDY = "serve with fewer --slots, --quantize or --dtype bfloat16"


@dataclass(frozen=True)
class ModelLen:
    value: int  # positions per request: prompt + max_tokens <= value
    line: str  # what was chosen and why, for the start-up log


def choose(
    cfg: ModelConfig, slots: int, dtype: torch.dtype, *, requested: int | None = None, free: int | None = None
) -> ModelLen:
    """The max-model-len to serve ``cfg`` with ``slots`` cache rows in ``dtype``. ``free``: bytes
    the cache may take (memory still available after the weights; None: unknown, not checked).
    ``requested``: the user's --max-model-len (None: the default). ValueError naming
    --max-model-len for a length outside [1, max_seq_len] or a cache that cannot fit."""
    allowed = cfg.max_seq_len
    if requested is not None and not (isinstance(requested, int) and 1 <= requested <= allowed):
        raise ValueError(
            f"{OPTION} {requested!r}: must be an integer in [1, {allowed}], the model's max_seq_len "
            "(positions it has been built for)"
        )
    per_position = kv_cache_bytes(cfg, 1, slots, dtype)  # one position of every row
    if requested is not None:
        check_fits(cfg, slots, dtype, requested, per_position, free)
        return ModelLen(requested, line(requested, slots, per_position, dtype, allowed, f"from {OPTION}"))
    if free is None:
        why = "the model's max_seq_len; free memory unknown, not checked"
        return ModelLen(allowed, line(allowed, slots, per_position, dtype, allowed, why))
    fits = int(DEFAULT_SHARE * free) // per_position
    if fits >= allowed:
        return ModelLen(allowed, line(allowed, slots, per_position, dtype, allowed, "the model's max_seq_len"))
    value = fits // STEP * STEP if fits >= STEP else fits
    if value < 1:
        raise ValueError(
            f"no KV cache fits: one position for {slots} slots takes {size(per_position)} ({dtype_name(dtype)}) and "
            f"only {size(free)} is free after the weights; {REMEDY}"
        )
    why = f"what fits in half of the {size(free)} free after the weights"
    return ModelLen(value, line(value, slots, per_position, dtype, allowed, why))


def check_fits(cfg: ModelConfig, slots: int, dtype, value: int, per_position: int, free: int | None) -> None:
    if free is None or value * per_position <= EXPLICIT_SHARE * free:
        return
    most = min(int(EXPLICIT_SHARE * free) // per_position, cfg.max_seq_len)
    allowed = f"allowed here: 1 to {most}, or fewer --slots" if most >= 1 else f"not one position fits; {REMEDY}"
    raise ValueError(
        f"{OPTION} {value}: its KV cache ({slots} slots x {value} positions) needs "
        f"{size(value * per_position)} in {dtype_name(dtype)}, but only {size(free)} is free after the weights; "
        f"{allowed}"
    )


def free_memory(to_come: int) -> int | None:
    """Bytes the cache may take: what this process may still allocate (host_memory), less
    ``to_come`` bytes of weights not yet in memory. None where memory cannot be read."""
    available = available_bytes()
    return None if available is None else max(0, available - to_come)


def line(value: int, slots: int, per_position: int, dtype, allowed: int, why: str) -> str:
    cache = f"cache {slots} slots x {value} positions = {size(value * per_position)} {dtype_name(dtype)}"
    change = "" if why.startswith("from") else f"; {OPTION} to change"
    return f"max-model-len {value}: {why} ({cache}; the model allows {allowed}{change})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def size(n: float) -> str:
    """Bytes in decimal units (1 GB = 1e9 B)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def for_loaded(model: DecoderLM, slots: int, requested: int | None) -> ModelLen:
    """``choose`` for a model already in memory (the engine's, before it allocates the cache); a
    length it chose is logged (one the CLI chose was said before loading). The memory left must
    also hold the copy of the weights ``packed`` makes while the engine runs (at most their size)."""
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    dtype = model.embed.tok.weight.dtype  # the cache's dtype (new_cache)
    chosen = choose(model.config, slots, dtype, requested=requested, free=free_memory(weights))
    if requested is None:
        log.info("%s", chosen.line)
    return chosen
