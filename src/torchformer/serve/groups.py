"""A request's first tokens, once its prompt is prefilled into one row: the n choices of a request
(``n`` > 1) get copies of that row (the prompt is prefilled once), the echoed prompt is scored,
and each choice draws its first token from the same logits with its own generator (jobs.py)."""

from __future__ import annotations

from torch import Tensor

from .jobs import Job
from .logprobs import TokenLogprob, prompt_logprobs, score


def first_tokens(
    engine, group: list[Job], rows: list[int], logits: Tensor, hidden: Tensor, vocab_size: int
) -> tuple[tuple[TokenLogprob, ...], list[int], list[TokenLogprob | None]]:
    """``group[0]`` is prefilled (logits (1, V), hidden (T, D) of its row); ``rows``: those of the
    other jobs, which get copies of its row (``engine.copy_row``). Returns (the echoed prompt's
    logprobs, each job's first token, its logprob); no tokens when max_tokens is 0 (echo only)."""
    leader, k = group[0], group[0].params.logprobs
    device = logits.device
    for job, row in zip(group[1:], rows):
        engine.copy_row(leader.row, row, len(leader.prompt))
        job.start(row, vocab_size, device)
    echo = ()
    if leader.params.echo and k is not None:
        echo = tuple(prompt_logprobs(engine.head, hidden, leader.prompt, k))
    if leader.max_tokens == 0:
        return echo, [], []
    tokens = [int(logits[0].argmax(-1) if job.fast else job.sample(logits)[0]) for job in group]
    scored = [None] * len(group) if k is None else score(logits.expand(len(group), -1), tokens, k)
    return echo, tokens, scored
