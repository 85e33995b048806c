"""Logits processors and the sampler: pure functions of (logits, state) -> logits.

Shapes: B batch, V vocabulary, L tokens so far. Every processor takes logits (B, V) and returns new
logits (B, V) with removed tokens at -inf; none of them reads a tensor value back to the host, so
a decode loop that uses them never waits on the device.

The order is fixed (the same as Hugging Face ``generate``) and is what ``process`` applies:

1. ``repetition_penalty``  on the raw scores (CTRL, Keskar et al. 2019)
2. ``block_repeated_ngrams`` tokens that would repeat an n-gram of the sequence
3. ``temperature``          divide by T (skipped for greedy, T = 0)
4. ``top_k``                keep the k largest
5. ``top_p``                keep the smallest set whose probability mass reaches p (nucleus)
6. ``min_p``                keep tokens with probability >= min_p * the top probability
7. ``sample``               exponential-noise argmax (or ``argmax`` when greedy)

The filters 4-6 see the tempered distribution, so a temperature changes which tokens survive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .topk import argmax as blocked_argmax

NEG_INF = float("-inf")


def repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Make tokens already in the sequence (seen (B, V) bool) less likely: positive logits are
    divided by ``penalty``, negative ones multiplied, so the push is always downwards."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def block_repeated_ngrams(logits: Tensor, tokens: Tensor, valid: Tensor, n: int) -> Tensor:
    """Forbid every token that would complete an n-gram already present in tokens (B, L).

    valid (B, L) marks real tokens (0 = left padding); n-grams touching padding do not count.
    """
    if tokens.shape[1] < n:
        return logits
    windows = tokens.unfold(1, n, 1)  # (B, L - n + 1, n)
    start = tokens.shape[1] - (n - 1)  # the last n - 1 tokens are the prefix of the next n-gram
    usable = valid.unfold(1, n, 1).all(-1) & valid[:, start:].all(-1, keepdim=True)  # (B, W)
    prefix = tokens[:, None, start:]  # (B, 1, n - 1)
    hits = (windows[..., :-1] == prefix).all(-1) & usable  # (B, W)
    # Count the hits per next-token (scatter_add: duplicate indices add up instead of racing).
    banned = torch.zeros_like(logits).scatter_add_(1, windows[..., -1], hits.to(logits.dtype)) > 0
    return logits.masked_fill(banned, NEG_INF)


def temperature(logits: Tensor, t: float) -> Tensor:
    return logits / t


def top_k(logits: Tensor, k: int) -> Tensor:
    """Keep exactly the k largest logits per row (ties broken by index), the rest -inf."""
    if k >= logits.shape[-1]:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, NEG_INF)


def top_p(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability mass is >= p. A token is kept when the mass of the tokens ranked above it is < p,
    so the top token always survives."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V) each
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def min_p(logits: Tensor, ratio: float) -> Tensor:
    """Keep tokens whose probability is at least ``ratio`` times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * ratio
    return logits.masked_fill(probs < threshold, NEG_INF)


def argmax(logits: Tensor) -> Tensor:
    """Greedy choice: (..., V) -> (...), the first index of each row's maximum, read in blocks
    (topk.py: torch's argmax compares one logit at a time; over the 1B shape's 128256 fp32 logits
    it took ~185 us a row here, ~0.6% of an int4 decode step)."""
    return blocked_argmax(logits.reshape(-1, logits.shape[-1])).reshape(logits.shape[:-1])


def sample(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row from softmax(logits): argmax of probs / E with E ~ Exponential(1).

    P(argmax_i p_i / E_i = j) = p_j (the exponential race), so this is an exact categorical
    sample with no ``multinomial`` and hence no host sync. (B, V) -> (B,).
    """
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


@dataclass(frozen=True)
class Sampling:
    """The user's choices, validated once by ``generate`` before any tensor work."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0


def process(logits: Tensor, s: Sampling, *, seen: Tensor | None, tokens: Tensor | None, valid: Tensor | None) -> Tensor:
    """Apply the processors of ``s`` in the documented order to logits (B, V) (float32)."""
    if s.repetition_penalty != 1.0:
        logits = repetition_penalty(logits, seen, s.repetition_penalty)
    if s.no_repeat_ngram_size > 0:
        logits = block_repeated_ngrams(logits, tokens, valid, s.no_repeat_ngram_size)
    if s.greedy:
        return logits  # the filters below never change the argmax
    if s.temperature != 1.0:
        logits = temperature(logits, s.temperature)
    if s.top_k is not None:
        logits = top_k(logits, s.top_k)
    if s.top_p is not None:
        logits = top_p(logits, s.top_p)
    if s.min_p is not None:
        logits = min_p(logits, s.min_p)
    return logits


def processed(logits: Tensor, s: Sampling, history) -> Tensor:
    """logits (B, V) float32 through every processor of ``s``; ``history`` (generate.History, kept
    only when a processor reads past tokens) or None. Temperature and the filters run either way."""
    if history is not None:
        return history.process(logits, s)
    return process(logits, s, seen=None, tokens=None, valid=None)


def choose(logits: Tensor, s: Sampling, generator: torch.Generator | None) -> Tensor:
    """The next token per row from processed logits: (B, V) -> (B,)."""
    return argmax(logits) if s.greedy else sample(logits, generator)
