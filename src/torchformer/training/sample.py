"""A text sample from a trained decoder, longer than its context if asked: generation continues
from the last half-context of text each time the window fills (nanoGPT's crop, done in chunks so
each chunk still decodes with the KV cache)."""

from __future__ import annotations

import torch

from ..generation.generate import generate


@torch.no_grad()
def sample_text(model, tokenizer, prompt: str, n_chars: int, *, temperature: float = 0.8, seed: int = 0) -> str:
    """prompt + about ``n_chars`` generated characters (char/byte tokenizers: exactly n tokens)."""
    model.eval()
    device = next(model.parameters()).device
    ids = [int(i) for i in tokenizer.encode(prompt)] or [tokenizer.bos_id]
    n_prompt, window = len(ids), model.config.max_seq_len
    text_len = lambda: len(tokenizer.decode(ids[n_prompt:]))  # noqa: E731
    chunk = 0
    while text_len() < n_chars:
        context = ids[-(window // 2) :] if len(ids) >= window else ids
        room = min(window - len(context), n_chars - text_len())
        x = torch.tensor([context], device=device)
        out = generate(model, x, max_new_tokens=max(1, room), temperature=temperature, seed=seed + chunk)
        ids += out[0, len(context) :].tolist()
        chunk += 1
    return prompt + tokenizer.decode(ids[n_prompt:])[:n_chars]
