"""Boundary checks for model inputs: clear errors before any tensor work."""

from __future__ import annotations

import torch
from torch import Tensor


def check_ids(ids: Tensor, name: str, vocab_size: int, max_seq_len: int) -> None:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, seq_len), got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError(f"{name} is empty (seq_len 0): give at least one token")
    if ids.shape[1] > max_seq_len:
        raise ValueError(f"{name} has seq_len {ids.shape[1]} > max_seq_len={max_seq_len} of this model")
    in_vocab = lambda: ((ids >= 0) & (ids < vocab_size)).all()  # noqa: E731
    if not value_checks_run(ids, in_vocab, f"{name}: ids outside [0, vocab_size={vocab_size})"):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} holds ids in [{lo}, {hi}], outside [0, vocab_size={vocab_size})")


def value_checks_run(t: Tensor, ok, message: str) -> bool:
    """Whether to check t's values here with a readable error (a host read).

    Reading a value back is free on CPU but, on an accelerator, a device sync every training or
    decoding step; compiled, ``int(t.max())`` is a graph break (issue 13 counted 3 per Llama
    step). So: compiled (decided at trace time) the forward trusts its inputs, which were checked
    where they entered (the tokenizer and batcher, generate's request, an eager call); on an
    accelerator the device checks ``ok()`` asynchronously (a device-side assert, no sync); on CPU
    the caller reads the values and raises a ValueError naming them.
    """
    if torch.compiler.is_compiling():
        return False
    if not t.is_cpu:
        torch._assert_async(ok(), message)
        return False
    return True


def check_mask(mask: Tensor | None, name: str, ids: Tensor, ids_name: str) -> None:
    if mask is None:
        return
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but {ids_name} has shape {tuple(ids.shape)}; they must match"
        )


def check_positions(positions: Tensor | None, ids: Tensor, cache, max_seq_len: int) -> None:
    """positions must fit the model's table and, with a cache, the cache's length."""
    if positions is None:
        if cache is not None:
            raise ValueError("positions is required with cache=...: pass the slots to write, e.g. arange(T)")
        return
    if positions.dtype.is_floating_point:
        raise TypeError(f"positions must be integers, got dtype {positions.dtype}")
    T = ids.shape[1]
    if tuple(positions.shape) not in ((T,), (1, T), tuple(ids.shape)):
        raise ValueError(
            f"positions has shape {tuple(positions.shape)}; "
            f"expected (T,) = ({T},), (1, T) or (B, T) = {tuple(ids.shape)}"
        )
    if cache is not None and cache.batch_size != ids.shape[0]:
        raise ValueError(f"cache was allocated for batch_size={cache.batch_size}, got a batch of {ids.shape[0]}")
    limit = max_seq_len if cache is None else min(max_seq_len, cache.max_len)
    in_range = lambda: ((positions >= 0) & (positions < limit)).all()  # noqa: E731
    if not value_checks_run(positions, in_range, f"positions outside [0, {limit})"):
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= max_seq_len:
        raise ValueError(f"positions span [{lo}, {hi}], outside [0, max_seq_len={max_seq_len})")
    if cache is not None and hi >= cache.max_len:
        raise ValueError(
            f"positions reach {hi} but the cache holds max_len={cache.max_len} positions; "
            "allocate a larger cache with new_cache(batch_size, max_len)"
        )


def check_documents(document_ids: Tensor | None, ids: Tensor, cache) -> None:
    """Packed rows: integer document ids of the ids' shape, and no cache (training only)."""
    if document_ids is None:
        return
    if not isinstance(document_ids, Tensor) or document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be an integer tensor, got {getattr(document_ids, 'dtype', document_ids)!r}")
    check_mask(document_ids, "document_ids", ids, "input_ids")
    if cache is not None:
        raise ValueError("document_ids (packed rows) cannot be combined with cache=...: pack for training only")
