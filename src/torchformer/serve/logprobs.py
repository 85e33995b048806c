"""Log-probabilities of tokens, as the OpenAI API reports them: the model's own distribution,
``log_softmax`` of the raw logits, before any sampling processor (temperature, top-k/p, min-p,
penalties), so a token's value does not depend on how it was chosen (vLLM's default,
``logprobs_mode`` raw_logprobs). Computed on the engine thread, one host read per step; the
app shapes them (logprob_shapes.py).

Legend: N tokens scored together, V vocabulary, k alternatives per token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class TokenLogprob(NamedTuple):
    token: int
    logprob: float | None  # None: the prompt's first token (nothing before it predicts it)
    top: tuple[tuple[int, float], ...]  # the k most likely tokens at this place, most likely first


def score(logits: Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits (N, V) predicting ``tokens`` (N ids) -> each token's logprob and the top ``k``."""
    lp = logits.float().log_softmax(-1)  # (N, V)
    index = torch.tensor(tokens, device=lp.device)[:, None]  # (N, 1)
    chosen = lp.gather(-1, index)[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, c, ()) for t, c in zip(tokens, chosen)]
    values, ids = lp.topk(k, dim=-1)  # (N, k) each
    tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]


def prompt_logprobs(model, hidden: Tensor, prompt: list[int], k: int) -> list[TokenLogprob]:
    """The prompt's own tokens scored by the prefill's hidden states (T, D) of its row: token t by
    position t - 1; the first has no logprob (OpenAI's null)."""
    first = TokenLogprob(prompt[0], None, ())
    if len(prompt) == 1:
        return [first]
    logits = model.lm_head(hidden[: len(prompt) - 1])  # (T - 1, V)
    return [first, *score(logits, prompt[1:], k)]


def step_logprobs(logits: Tensor, rows: list[int], tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """A decode step's logits (n, V) -> the chosen ``tokens`` of ``rows``, each row with its own
    number of alternatives ``ks`` (one top-k at the largest, then cut)."""
    entries = score(logits[rows], tokens, max(ks))
    return [e._replace(top=e.top[:k]) for e, k in zip(entries, ks)]
