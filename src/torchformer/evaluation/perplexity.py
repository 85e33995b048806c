"""Perplexity with a strided sliding window, bits per byte, and seq2seq accuracy.

A model with context T cannot score a long file in one pass. Cutting it into disjoint windows
scores each window's first tokens with almost no context; the sliding window (the procedure in
transformers' "Perplexity of fixed-length models" guide, with max_length = seq_len + 1) moves
windows by ``stride`` and scores, in each, only the tokens no earlier window scored. Every token
from the second on is scored exactly once, with at least seq_len - stride tokens of context
(stride = seq_len: back-to-back windows; stride = 1: the full context every time).

Bits per byte = total NLL / ln 2 / UTF-8 bytes of the scored text: comparable across tokenizers
(Gao et al. 2020, "The Pile", section 4).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..nn.loss import IGNORE, token_loss


@dataclass(frozen=True)
class Score:
    nll: float  # summed negative log-likelihood, nats
    tokens: int  # tokens scored
    n_bytes: int | None = None  # UTF-8 bytes of the scored text, when known

    @property
    def loss(self) -> float:
        return self.nll / max(1, self.tokens)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.n_bytes else self.nll / math.log(2) / self.n_bytes

    def to_dict(self) -> dict:
        return {
            "loss": self.loss,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
            "tokens": self.tokens,
            "bytes": self.n_bytes,
        }


def windows(n: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) of each window over n tokens. A window holds seq_len + 1
    tokens: the model reads seq_len of them (its context, as data.seq_len in training) and each
    predicts the next. Window [begin, end) scores targets [first, end), which no earlier window
    scored; stride <= seq_len keeps the windows overlapping, so no target is skipped."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: must be an integer >= 1 (tokens of context per window)")
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= seq_len:
        raise ValueError(f"stride={stride!r}: must be an integer in [1, seq_len={seq_len}]")
    if n < seq_len + 1:
        raise ValueError(
            f"the data holds {n} tokens, fewer than one window (seq_len + 1 = {seq_len + 1}): "
            "give more text or a smaller --seq-len"
        )
    out, scored_to = [], 1  # token 0 has no context: never a target
    for begin in range(0, n, stride):
        end = min(begin + seq_len + 1, n)
        out.append((begin, end, scored_to))
        scored_to = end
        if end == n:
            break
    return out


@torch.no_grad()
def strided_nll(
    model: nn.Module,
    ids: Tensor,
    *,
    seq_len: int,
    stride: int,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> Score:
    """Summed NLL of ``ids`` (N,) under the causal LM ``model`` with the sliding window.
    progress(k) is called after each batch with the number of windows it held."""
    ids = ids.reshape(-1).long()
    spans = windows(len(ids), seq_len, stride)
    was, nll, count = model.training, 0.0, 0
    model.eval()
    device = next(model.parameters()).device
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for span in spans:  # windows of one length batch together (only the last may be shorter)
        by_length.setdefault(span[1] - span[0], []).append(span)
    for group in by_length.values():
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            x = torch.stack([ids[b:e] for b, e, _ in chunk]).to(device)  # (B, L)
            labels = x[:, 1:].clone()  # (B, L - 1): position j predicts token begin + j + 1
            for row, (b, _, first) in enumerate(chunk):
                labels[row, : first - b - 1] = IGNORE  # already scored by an earlier window
            nll += float(token_loss(model(x[:, :-1]), labels))
            count += int((labels != IGNORE).sum())
            progress(len(chunk)) if progress is not None else None
    model.train(was)
    assert count == len(ids) - 1, (count, len(ids))  # every token after the first, exactly once
    return Score(nll, count)


def text_perplexity(
    model: nn.Module, tokenizer, text: str, *, seq_len: int, stride: int, batch_size: int = 8, progress=None
) -> Score:
    """``strided_nll`` of ``text`` tokenized by a HF ``tokenizers.Tokenizer`` (or our TextTokenizer),
    with bits per byte over the text after its first token (which only serves as context)."""
    ids = _encode(tokenizer, text)
    score = strided_nll(model, ids, seq_len=seq_len, stride=stride, batch_size=batch_size, progress=progress)
    first = tokenizer.decode([int(ids[0])])
    return Score(score.nll, score.tokens, len(text.encode("utf-8")) - len(first.encode("utf-8")))


def _encode(tokenizer, text: str) -> Tensor:
    encoded = tokenizer.encode(text)
    ids = getattr(encoded, "ids", encoded)  # tokenizers.Encoding or an id array
    return torch.as_tensor(list(ids) if not hasattr(ids, "dtype") else ids, dtype=torch.long)


@torch.no_grad()
def seq2seq_accuracy(model: nn.Module, batches) -> dict:
    """Teacher-forced token accuracy and exact match over PairBatches-style batches (src, src_mask,
    tgt, labels). A pair is an exact match when every target token and the end token are the
    argmax given the true prefix, which is exactly when greedy decoding reproduces the target."""
    was, correct, total, exact, pairs, nll = model.training, 0, 0, 0, 0, 0.0
    model.eval()
    for batch in batches:
        logits = model(batch["src"], batch["tgt"], src_mask=batch["src_mask"])  # (B, T, V)
        labels = batch["labels"]
        real = labels != IGNORE
        hit = (logits.argmax(-1) == labels) & real
        correct, total = correct + int(hit.sum()), total + int(real.sum())
        exact, pairs = exact + int((hit | ~real).all(-1).sum()), pairs + len(labels)
        nll += float(token_loss(logits, labels))
    model.train(was)
    return {
        "token_accuracy": correct / max(1, total),
        "exact_match": exact / max(1, pairs),
        "loss": nll / max(1, total),
        "pairs": pairs,
        "tokens": total,
    }
