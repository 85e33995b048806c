"""What the engine does to rows of its static cache: views of some rows, batched prefill into
consecutive rows, and the decode step over all of them (engine.py owns the scheduling).

Legend: b rows prefilled together, T their longest prompt, n decode rows, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..nn.kv_cache import KVCache, LayerCache

SPAN = 64  # attended key slots come in multiples of this: few shapes, little attention to empty slots


def span(positions: int, max_len: int) -> int:
    """Key slots to attend over when positions 0..positions-1 are in use."""
    return min(max_len, -(-positions // SPAN) * SPAN)


def row_bucket(rows: int, slots: int) -> int:
    """Rows a compiled decode step runs when rows 0..rows-1 are busy: the next power of two, at most
    ``slots``. One graph per bucket (log2(slots) + 1 of them), and a step never pays for more than
    twice the rows in use (measured: an all-slots step for one request ran slower than eager)."""
    return min(slots, 1 << (rows - 1).bit_length())


def row_buckets(slots: int) -> list[int]:
    """Every row count a compiled decode step may run with ``slots`` rows: row_bucket's values."""
    return sorted({row_bucket(n, slots) for n in range(1, slots + 1)})


def rows_view(cache: KVCache, start: int, stop: int, length: int) -> KVCache:
    """Rows start..stop-1 and slots 0..length-1 of the cache, with slot ``length`` as the hidden
    slot; index_put_ through the views writes the cache in place. The hidden slot of a short view
    is a real slot of the cache, so an idle row may leave a dummy key there: harmless, since a
    row writes every position before any of its queries can see it."""
    layers = [LayerCache(c.k[start:stop, :, : length + 1], c.v[start:stop, :, : length + 1]) for c in cache.layers]
    return KVCache(layers, length)


PREFILL_TOKENS = 2048  # padded tokens in one batched prefill: bounds its activations
PAD_SLACK = 64  # pad tokens a batched prefill may add beyond a quarter of its real ones


def prefill_rows(model, cache: KVCache, start: int, prompts: list[list[int]], offset: int = 0) -> tuple[Tensor, Tensor]:
    """Run prompts into rows start..start+b-1 of the cache in one forward: logits (b, V) for each
    one's first new token, and the hidden states (b, T, D) (prompt logprobs read them). Shorter
    prompts are right-padded; the pad tokens' attention_mask is 0, so their keys go to the hidden
    slot and each row ends as its own prefill would leave it (its queries see only its own slots
    at positions <= theirs). ``offset``: the rows already hold slots 0..offset-1 (a reused
    prefix, prefix.py) and the prompts are the tokens after it, at positions offset.. ."""
    b, T = len(prompts), max(map(len, prompts))
    view = rows_view(cache, start, start + b, span(offset + T, cache.max_len))
    device = cache.layers[0].k.device
    ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)  # (b, T)
    pos = torch.arange(offset, offset + T, device=device)[None, :].expand(b, T)  # (b, T)
    mask = None
    if any(len(p) < T for p in prompts):
        mask = torch.tensor([[1] * len(p) + [0] * (T - len(p)) for p in prompts], device=device)  # (b, T)
    hidden = model.hidden(ids, pos, mask, view)  # (b, T, D)
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)  # (b,)
    return model.lm_head(hidden[torch.arange(b, device=device), last]), hidden  # (b, V), as steps.prefill does


def copy_row(cache: KVCache, src: int, dst: int, length: int) -> None:
    """Row ``dst`` holds what row ``src`` holds at slots 0..length-1: a prompt prefilled once
    serves the n choices of a request (the rest of dst's slots stay invisible: module docstring
    of engine.py)."""
    for layer in cache.layers:
        layer.k[dst, :, :length] = layer.k[src, :, :length]
        layer.v[dst, :, :length] = layer.v[src, :, :length]


def prefill_batches(admitted: list[tuple[int, list[int]]]) -> list[list[int]]:
    """Group (row, prompt) pairs, sorted by row, into batched prefills: runs of consecutive rows
    whose padded size stays within PREFILL_TOKENS and whose padding within a quarter of the real
    tokens (or PAD_SLACK, for short prompts, where one more forward costs more than the pads).
    Returns lists of indices into ``admitted``."""
    groups: list[list[int]] = []
    for i, (row, prompt) in enumerate(admitted):
        if groups:
            group = groups[-1]
            n, T = len(group) + 1, max(len(prompt), *(len(admitted[j][1]) for j in group))
            real = len(prompt) + sum(len(admitted[j][1]) for j in group)
            next_row = row == admitted[group[-1]][0] + 1
            if next_row and n * T <= PREFILL_TOKENS and n * T - real <= max(PAD_SLACK, real // 4):
                group.append(i)
                continue
        groups.append([i])
    return groups


def decode_rows(model, ids: Tensor, pos: Tensor, live: Tensor, cache: KVCache) -> Tensor:
    """ids, pos, live (n, 1) -> logits (n, V); rows with live 0 write to the hidden slot."""
    return model.logits(ids, pos, live, cache)[:, -1]
