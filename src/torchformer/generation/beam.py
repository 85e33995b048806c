"""Beam search over the static KV cache, for EncoderDecoder (the 2017 recipe) and DecoderLM.

Legend: B batch, K beam_size, V vocabulary. Each batch item keeps K open beams (rows b*K .. b*K +
K - 1 of the cache). A step scores every open beam's continuations, log p summed along the beam,
and keeps the K best that are not EOS. A candidate ending in EOS (among the K best) retires as a
finished hypothesis with score

    sum of log p over its generated tokens (EOS included) / length ** length_penalty

(length = generated tokens, EOS included; length_penalty > 0 favours longer outputs, 0 compares
raw log-probabilities; Wu et al. 2016 use a similar normaliser). An item is done once it holds
n_best finished hypotheses and no open beam can still beat the n_best-th of them: log p <= 0, so
an open beam's sum can only fall; its best reachable score is its sum divided by the most
favourable length. At max_new_tokens the open beams are scored as they stand.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..fast.scope import packed
from .request import Request, check_float, check_int, make_request
from .steps import check_compile_settings, loop_step, prefill


class Beams(NamedTuple):
    sequences: Tensor  # (B, n_best, T0 + L): prefix then tokens, best first, padded with pad_token_id
    scores: Tensor  # (B, n_best) the length-normalised scores, best first


class Item:
    """One batch item's finished hypotheses and stopping rule."""

    def __init__(self, n_best: int, max_new: int, length_penalty: float) -> None:
        self.finished: list[tuple[float, list[int]]] = []
        self.n_best, self.max_new, self.alpha = n_best, max_new, length_penalty
        self.done = False

    def score(self, total: float, length: int) -> float:
        return total / length**self.alpha

    def add(self, total: float, tokens: list[int]) -> None:
        self.finished.append((self.score(total, len(tokens)), tokens))
        self.finished.sort(key=lambda h: -h[0])

    def update_done(self, best_open: float, length: int) -> None:
        """length = tokens the open beams hold now; they can still grow to max_new."""
        if len(self.finished) < self.n_best:
            return
        reachable = self.max_new if self.alpha > 0 else min(length + 1, self.max_new)
        self.done = best_open == -math.inf or self.score(best_open, reachable) <= self.finished[self.n_best - 1][0]


def beam_search(
    model,
    input_ids: Tensor,
    *,
    beam_size: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    n_best: int = 1,
    attention_mask: Tensor | None = None,
    pad_token_id: int | None = None,
    decoder_start_token_id: int | None = None,
    compile: bool = False,
) -> Beams:
    """The n_best highest-scoring continuations of each row of input_ids (B, T) (the source for an
    EncoderDecoder, the prompt for a DecoderLM; masks as in ``generate``). See the module
    docstring for the score. sequences start with the prompt (DecoderLM) or the decoder start
    token (EncoderDecoder), like ``generate``'s output. ``compile=True`` compiles the step
    (batch x beam rows, static shapes) once."""
    req = make_request(
        model,
        input_ids,
        max_new_tokens=max_new_tokens,
        attention_mask=attention_mask,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        decoder_start_token_id=decoder_start_token_id,
    )
    check_int("beam_size", beam_size, 1)
    check_int("n_best", n_best, 1)
    if n_best > beam_size:
        raise ValueError(f"n_best={n_best}: must be <= beam_size={beam_size}")
    check_float("length_penalty", length_penalty, lambda a: True, "must be a finite number")
    check_compile_settings(bool(compile))
    with packed(model, input_ids.shape[0] * beam_size):  # few-row products over packed weights (fast/panels.py)
        sequences, scores = search(model, req, beam_size, n_best, float(length_penalty), bool(compile))
    return Beams(sequences.clone(), scores.clone())  # clone: normal tensors, usable with autograd


@torch.inference_mode()
def search(model, req: Request, beam_size: int, n_best: int, length_penalty: float, compiled: bool = False) -> Beams:
    """The search itself, on validated arguments (module docstring)."""
    max_new_tokens = req.max_new_tokens
    logits, cache, pos, prefix = prefill(model, req)
    B, K, V = prefix.shape[0], beam_size, logits.shape[-1]
    rows = torch.arange(B, device=prefix.device).repeat_interleave(K)  # (B*K,) beam row -> batch item
    cache.reorder(rows)
    pos, logp = pos[rows], logits.float().log_softmax(-1)[rows]  # (B*K, 1), (B*K, V)
    totals = torch.full((B, K), -math.inf, device=logits.device)
    totals[:, 0] = 0.0  # all K beams start identical: let only one of them expand at first
    eos = set() if req.eos is None else set(req.eos.tolist())
    items = [Item(n_best, max_new_tokens, length_penalty) for _ in range(B)]
    beams: list[list[int]] = [[] for _ in range(B * K)]
    step = loop_step(model, req.seq2seq, compiled)
    for length in range(1, max_new_tokens + 1):
        cand = (totals.view(B * K, 1) + logp).view(B, K * V)
        top, index = cand.topk(min(K * (len(eos) + 1), K * V), dim=1)  # enough to find K non-EOS
        keep_rows, keep_tok, keep_total = select(items, top.tolist(), index.tolist(), beams, K, V, eos)
        index_t = torch.tensor(keep_rows, device=prefix.device)
        beams = [beams[r] + [t] for r, t in zip(keep_rows, keep_tok)]
        totals = torch.tensor(keep_total, device=logits.device).view(B, K)
        for b, item in enumerate(items):
            if not item.done:
                item.update_done(max(keep_total[b * K : (b + 1) * K]), length)
        if length == max_new_tokens or all(item.done for item in items):
            break
        cache.reorder(index_t)
        tok = torch.tensor(keep_tok, device=prefix.device, dtype=prefix.dtype)[:, None]  # (B*K, 1)
        logp = step(model, tok, pos, cache).float().log_softmax(-1)  # (B*K, V)
        pos = pos + 1
    retire_open(items, keep_total, beams, K)
    return assemble(items, prefix, n_best, req.pad_token_id)


def retire_open(items: list[Item], totals: list[float], beams: list[list[int]], K: int) -> None:
    """Out of steps: the open beams of unfinished items compete as they stand."""
    for b, item in enumerate(items):
        for k in range(K):
            if not item.done and totals[b * K + k] > -math.inf:
                item.add(totals[b * K + k], beams[b * K + k])


def select(items, top, index, beams, K: int, V: int, eos: set[int]):
    """Per item: retire EOS candidates ranked among the K best, keep the K best others.

    Returns, per new beam row, the old row it extends, its token and its summed log p.
    """
    rows, toks, totals = [], [], []
    for b, item in enumerate(items):
        kept = []
        for rank, (total, flat) in enumerate(zip(top[b], index[b])):
            row, tok = b * K + flat // V, flat % V
            if tok in eos:
                if rank < K and total > -math.inf and not item.done:
                    item.add(total, beams[row] + [tok])
                continue
            kept.append((row, tok, total))
            if len(kept) == K:
                break
        while len(kept) < K:  # a tiny vocabulary: dead filler beams
            kept.append((b * K, 0, -math.inf))
        if item.done:  # finished items idle: keep computing, never score again
            kept = [(row, tok, -math.inf) for row, tok, _ in kept]
        rows += [row for row, _, _ in kept]
        toks += [tok for _, tok, _ in kept]
        totals += [total for _, _, total in kept]
    return rows, toks, totals


def assemble(items: list[Item], prefix: Tensor, n_best: int, pad: int) -> Beams:
    """Stack the n_best hypotheses of every item, padded to the longest."""
    best = [item.finished[:n_best] for item in items]
    length = max((len(tokens) for hyps in best for _, tokens in hyps), default=0)
    B = prefix.shape[0]
    out = torch.full((B, n_best, prefix.shape[1] + length), pad, dtype=prefix.dtype, device=prefix.device)
    scores = torch.full((B, n_best), -math.inf, device=prefix.device)
    out[:, :, : prefix.shape[1]] = prefix[:, None, :]
    for b, hyps in enumerate(best):
        for n, (score, tokens) in enumerate(hyps):
            out[b, n, prefix.shape[1] : prefix.shape[1] + len(tokens)] = torch.tensor(tokens, dtype=prefix.dtype)
            scores[b, n] = score
    return Beams(out, scores)
