"""Log-probabilities of tokens, as the OpenAI API reports them: the model's own distribution,
``log_softmax`` of the raw logits, before any sampling processor (temperature, top-k/p, min-p,
penalties), so a token's value does not depend on how it was chosen (vLLM's default,
``logprobs_mode`` raw_logprobs). Computed on the engine thread, batched over the rows that asked,
one host read per step; the app shapes them (logprob_shapes.py).

Legend: N tokens scored together, V vocabulary, k alternatives per token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..generation.topk import top_k


class TokenLogprob(NamedTuple):
    token: int
    logprob: float | None  # None: the prompt's first token (nothing before it predicts it)
    top: tuple[tuple[int, float], ...]  # the k most likely tokens at this place, most likely first


def score(logits: Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits (N, V) predicting ``tokens`` (N ids) -> each token's logprob and the top ``k``: one
    log_softmax, top-k read in blocks (generation/topk.py: 2-6x torch's own on the CPU) and one host read of
    every value (the engine thread pays this each step)."""
    lp = logits.float().log_softmax(-1)  # (N, V)
    picked = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])  # (N, 1)
    if k == 0:
        return [TokenLogprob(t, v[0], ()) for t, v in zip(tokens, picked.tolist())]
    values, ids = top_k(lp, k)  # (N, k) each
    rows = torch.cat([picked, values], 1).tolist()  # (N, 1 + k): the chosen one, then the top k
    return [TokenLogprob(t, r[0], tuple(zip(i, r[1:]))) for t, r, i in zip(tokens, rows, ids.tolist())]


def prompt_logprobs(head, hidden: Tensor, prompt: list[int], k: int) -> list[TokenLogprob]:
    """The prompt's own tokens scored by the prefill's hidden states (T, D) of its row: token t by
    position t - 1 (``head``: the model's LM head); the first has no logprob (OpenAI's null)."""
    first = TokenLogprob(prompt[0], None, ())
    if len(prompt) == 1:
        return [first]
    logits = head(hidden[: len(prompt) - 1])  # (T - 1, V)
    return [first, *score(logits, prompt[1:], k)]


def step_logprobs(logits: Tensor, rows: list[int], tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """A decode step's logits (n, V) -> the chosen ``tokens`` of ``rows``, each row with its own
    number of alternatives ``ks`` (one top-k at the largest, then cut). All n rows asking (the
    usual case at full load) read the logits as they are, with no (m, V) copy of the rows."""
    every = rows == list(range(logits.shape[0]))
    entries = score(logits if every else logits[rows], tokens, max(ks))
    if min(ks) == max(ks):
        return entries
    return [e._replace(top=e.top[:k]) for e, k in zip(entries, ks)]
