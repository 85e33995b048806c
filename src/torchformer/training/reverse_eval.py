"""Held-out evaluation of a seq2seq model: greedy exact match and a cross-attention picture."""

from __future__ import annotations

import torch

from ..analysis.plots import ascii_attention
from ..analysis.record import record_attention
from ..generation.generate import generate


def _source_batch(tok, sources: list) -> tuple[torch.Tensor, torch.Tensor]:
    S = max(len(s) for s in sources) + 1
    src = torch.full((len(sources), S), tok.pad_id, dtype=torch.long)
    for i, s in enumerate(sources):
        src[i, : len(s) + 1] = torch.tensor([*map(int, s), tok.eos_id])
    return src, (src != tok.pad_id).long()


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos)] if eos in row else row


@torch.no_grad()
def greedy(model, tok, sources: list) -> list[list[int]]:
    """Greedy outputs (without start and end tokens) for token-id sources."""
    src, mask = _source_batch(tok, sources)
    longest = max(len(s) for s in sources) + 2
    out = generate(model.eval(), src, attention_mask=mask, max_new_tokens=longest, eos_token_id=tok.eos_id)
    return [_until_eos(row[1:], tok.eos_id) for row in out.tolist()]


def exact_match(model, tok, pairs, batch_size: int = 128) -> tuple[float, list[tuple[str, str, str]]]:
    """Share of (source, target) id pairs whose greedy output equals the target exactly, and
    (source, target, output) strings for every pair."""
    examples = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        for (s, t), got in zip(chunk, greedy(model, tok, [s for s, _ in chunk])):
            examples.append((tok.decode(s), tok.decode(t), tok.decode(got)))
    hits = sum(want == got for _, want, got in examples)
    return hits / max(1, len(examples)), examples


@torch.no_grad()
def cross_attention_ascii(model, tok, source: str) -> str:
    """The last decoder layer's cross-attention (mean over heads) while the model writes its
    answer for ``source``: one row per output token, one column per source token."""
    ids = [int(i) for i in tok.encode(source)]
    out = greedy(model, tok, [ids])[0]
    src, mask = _source_batch(tok, [ids])
    tgt = torch.tensor([[tok.bos_id, *out]])
    last = len(model.decoder.blocks) - 1
    with record_attention(model, layers=[f"decoder.blocks.{last}.cross_attn"]) as rec:
        model(src, tgt, src_mask=mask)
    weights = rec.captures[-1].weights[0].mean(0)  # (T, S)
    rows = [tok.decode([i]) for i in out] + ["</s>"]
    cols = [tok.decode([i]) for i in ids] + ["</s>"]
    return ascii_attention(weights, labels=rows, key_labels=cols, width=4)
