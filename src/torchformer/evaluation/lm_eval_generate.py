"""generate_until's decoding for the lm-eval backend: a left-padded batch through ``tfm.stream``,
stopped once every row has produced the EOS id or one of its stop sequences (lm-eval cuts the
text at the first stop sequence afterwards, so tokens past it would be wasted work)."""

from __future__ import annotations

import torch

from ..generation import stream

CHECK_EVERY = 4  # decode the rows' texts to look for stop sequences every few tokens, not every token


def generate_batch(lm, prompts: list[list[int]], budget: int, until: list[str], sampling: dict) -> list[str]:
    """Each prompt's continuation of up to ``budget`` tokens, decoded without special tokens."""
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.full((B, T), lm.pad, dtype=torch.long)  # (B, T), left-padded
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[b, T - len(p) :] = 1
    options = _options(sampling)
    new: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    with torch.inference_mode():
        tokens = stream(lm.model, ids.to(lm.device), attention_mask=mask.to(lm.device), max_new_tokens=budget,
                        eos_token_id=lm._eot, pad_token_id=lm.pad, **options)  # fmt: skip
        for n, tok in enumerate(tokens, 1):
            for b, t in enumerate(tok.tolist()):
                if not done[b]:
                    new[b].append(t)
                    done[b] = t == lm._eot
            if n % CHECK_EVERY == 0 and all(done[b] or _stopped(lm, new[b], until) for b in range(B)):
                break
    return [lm.tokenizer.decode([t for t in row if t != lm._eot], skip_special_tokens=True) for row in new]


def _stopped(lm, row: list[int], until: list[str]) -> bool:
    text = lm.tokenizer.decode(row, skip_special_tokens=True)
    return any(stop and stop in text for stop in until)


def _options(sampling: dict) -> dict:
    """lm-eval's normalized generation kwargs as ``tfm.stream`` arguments: greedy unless do_sample."""
    if not sampling.get("do_sample"):
        return {"temperature": 0.0}
    keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
    return {k: sampling[k] for k in keys if sampling.get(k) is not None}
