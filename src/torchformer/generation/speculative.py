"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with a draft model or prompt lookup.

Legend: k draft tokens per round, V vocabulary, n tokens so far (prompt + new). Batch 1.

A round: a proposer guesses k tokens d_1..d_k with probabilities q_i (a point mass for prompt
lookup, whose candidates are copied from the last earlier occurrence of the trailing n-gram, as in
Saxena 2023). The target runs ONE forward over [seq[n-1], d_1..d_k] at positions n-1..n-1+k of its
static cache and gets p_1..p_{k+1}. Greedy keeps the d_i that equal the target's argmax, then adds
the target's own token: the output is plain greedy's, token for token. Sampled keeps d_i with
probability min(1, p_i(d_i) / q_i(d_i)) and, at the first rejection, samples from the normalised
residual max(0, p_i - q_i) (after k acceptances: from p_{k+1}); every emitted token then follows
the target's distribution exactly. Rejected positions of either cache are simply overwritten
later: a query at position t only sees slots <= t, all of which hold accepted tokens.

Invariant between rounds: both caches hold seq[:n-1] (the draft perhaps more). The draft
re-reads seq[n-2:n] (2 tokens; re-writing slot n-2 with the same token is harmless) so every
round has the same shapes: one compiled graph per step kind, no recompiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..fast.scope import packed
from .request import Request
from .sampling import Sampling, argmax, process, sample
from .steps import chunk_step, prompt_hidden, step_function

LOOKUP_MAX_NGRAM = 3  # longest trailing n-gram prompt lookup tries to match (then 2, then 1)


@dataclass
class Acceptance:
    """How many proposed tokens the target kept (CLI --verbose)."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")


def draft_chunk_step(model, ids: Tensor, pos: Tensor, cache) -> Tensor:
    """The draft's 2-token re-read (its own compiled graph, apart from the target's verify)."""
    return model.logits(ids, pos, None, cache)[:, -1]


def probabilities(logits: Tensor, s: Sampling) -> Tensor:
    """The distribution a token is drawn from: softmax of the processed logits (R, V)."""
    return process(logits.float(), s, seen=None, tokens=None, valid=None).softmax(-1)


def verify(cand: Tensor, q: Tensor | None, target_logits: Tensor, s: Sampling, generator) -> tuple[Tensor, Tensor]:
    """Rows R of candidates cand (R, k) with draft probabilities q (R, k, V) (None: point masses)
    against the target's logits (R, k + 1, V) -> (accepted count (R,), the token after them (R,))."""
    R, k = cand.shape
    rows = torch.arange(R, device=cand.device)
    if s.greedy:
        target = argmax(target_logits)  # (R, k + 1)
        accepted = (cand == target[:, :k]).long().cumprod(-1).sum(-1)  # leading matches (R,)
        return accepted, target[rows, accepted]
    p = probabilities(target_logits.flatten(0, 1), s).view(R, k + 1, -1)  # (R, k + 1, V)
    p_d = p[:, :k].gather(-1, cand[..., None])[..., 0]  # (R, k): target probability of each candidate
    q_d = torch.ones_like(p_d) if q is None else q.gather(-1, cand[..., None])[..., 0]
    u = torch.rand(p_d.shape, generator=generator, device=p_d.device)
    accepted = (u * q_d <= p_d).long().cumprod(-1).sum(-1)  # accept with min(1, p/q) (R,)
    p_next = p[rows, accepted]  # (R, V)
    q_all = torch.nn.functional.one_hot(cand, p.shape[-1]).to(p.dtype) if q is None else q  # (R, k, V)
    q_next = torch.cat([q_all, torch.zeros_like(p_next[:, None])], 1)[rows, accepted]  # (R, V); 0 after k
    residual = (p_next - q_next).clamp(min=0)
    # p == q exactly leaves no residual mass; any rejection there has probability 0, keep p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    return accepted, sample(residual.log(), generator)


class DraftProposer:
    """A smaller DecoderLM guesses k tokens, sampling (or argmax) from its processed distribution."""

    def __init__(self, draft, prompt: Tensor, max_len: int, k: int, s: Sampling, generator, compiled: bool) -> None:
        self.model, self.k, self.s, self.generator = draft, k, s, generator
        self.cache = draft.new_cache(1, min(draft.config.max_seq_len, max_len))
        pos = torch.arange(prompt.shape[1], device=prompt.device)[None, :]  # (1, P)
        self.first = draft.lm_head(prompt_hidden(draft, prompt, pos, None, self.cache))  # (1, V)
        self.chunk = step_function(False, compiled, draft_chunk_step, model=draft)
        self.step = step_function(False, compiled, model=draft)

    def position(self, p: int) -> Tensor:
        # Clamped to the draft's cache: past it (a draft with a shorter max_seq_len) it only guesses.
        return torch.tensor([[min(p, self.cache.max_len - 1)]], device=self.cache.layers[0].k.device)

    def propose(self, seq: Tensor, n: int) -> tuple[Tensor, Tensor | None]:
        """Candidates (1, k) and their probabilities (1, k, V) for the tokens after seq[:, :n]."""
        if self.first is not None:
            logits, self.first = self.first, None  # round 1: the prompt's prefill already gave q_1
        else:
            pos = torch.cat([self.position(n - 2), self.position(n - 1)], 1)  # (1, 2)
            logits = self.chunk(self.model, seq[:, n - 2 : n], pos, self.cache)
        toks, probs = [], []
        for i in range(self.k):
            if i:
                logits = self.step(self.model, toks[-1][:, None], self.position(n + i - 1), self.cache)
            q = probabilities(logits, self.s)  # (1, V)
            toks.append(argmax(q) if self.s.greedy else sample(q.log(), self.generator))
            probs.append(q)
        return torch.stack(toks, 1), None if self.s.greedy else torch.stack(probs, 1)


class LookupProposer:
    """Prompt lookup: copy the k tokens that followed the last earlier occurrence of the trailing
    n-gram (n = 3, 2, 1); with no match, repeat the last token (verified like any guess)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, seq: Tensor, n: int) -> tuple[Tensor, None]:
        tokens = seq[0, :n].tolist()
        guess = []
        for m in range(min(LOOKUP_MAX_NGRAM, n - 1), 0, -1):
            tail = tokens[n - m :]
            for start in range(n - m - 1, -1, -1):  # latest occurrence first, not the tail itself
                if tokens[start : start + m] == tail:
                    guess = tokens[start + m : start + m + self.k]
                    break
            if guess:
                break
        guess = (guess + [tokens[-1]] * self.k)[: self.k]
        return torch.tensor([guess], dtype=seq.dtype, device=seq.device), None


@torch.inference_mode()
def speculate(model, req: Request, s: Sampling, generator, compiled: bool, proposer_of, k: int, stats: Acceptance):
    """Yield each new token (1,); ``proposer_of(prompt, max_len)`` makes the proposer."""
    # The target's verify chunk multiplies k + 1 rows by every weight: packed products (fast/panels.py).
    with packed(model, k + 1):
        yield from rounds(model, req, s, generator, compiled, proposer_of, k, stats)


def rounds(model, req: Request, s: Sampling, generator, compiled: bool, proposer_of, k: int, stats: Acceptance):
    prompt = req.input_ids if req.attention_mask is None else req.input_ids[:, req.attention_mask[0].bool()]
    P, budget = prompt.shape[1], req.max_new_tokens
    max_len = min(model.config.max_seq_len, P + budget + k)
    cache = model.new_cache(1, max_len)
    if P > 1:  # the target holds seq[:n-1]; seq[n-1] opens the first verify chunk
        prompt_hidden(model, prompt[:, :-1], torch.arange(P - 1, device=prompt.device)[None, :], None, cache)
    proposer = proposer_of(prompt, max_len)
    target = step_function(False, compiled, chunk_step, model=model)
    seq = torch.zeros(1, P + budget + k + 1, dtype=prompt.dtype, device=prompt.device)
    seq[:, :P] = prompt
    n, eos = P, set() if req.eos is None else set(req.eos.tolist())
    while n < P + budget:
        cand, q = proposer.propose(seq, n)  # (1, k), (1, k, V) | None
        chunk = torch.cat([seq[:, n - 1 : n], cand], 1)  # (1, k + 1)
        pos = torch.arange(n - 1, n + k, device=seq.device).clamp(max=max_len - 1)[None, :]  # (1, k + 1)
        accepted, nxt = verify(cand, q, target(model, chunk, pos, cache), s, generator)
        a = int(accepted[0])
        new = [*cand[0, :a].tolist(), int(nxt[0])][: P + budget - n]
        stats.proposed, stats.accepted, stats.rounds = stats.proposed + k, stats.accepted + a, stats.rounds + 1
        for tok in new:
            seq[0, n] = tok
            n += 1
            yield seq[0, n - 1 : n].clone()
            if tok in eos:
                return


class SpeculativeStream:
    """The token iterator ``stream`` returns for speculative decoding; ``acceptance`` counts
    proposed and kept tokens as it runs."""

    def __init__(self, model, req: Request, s: Sampling, generator, compiled: bool, draft, k: int) -> None:
        self.acceptance = Acceptance()

        def proposer_of(prompt: Tensor, max_len: int):
            if draft is None:
                return LookupProposer(k)
            return DraftProposer(draft, prompt, max_len, k, s, generator, compiled)

        self._tokens = speculate(model, req, s, generator, compiled, proposer_of, k, self.acceptance)

    def __iter__(self) -> Iterator[Tensor]:
        return self

    def __next__(self) -> Tensor:
        return next(self._tokens)
