"""Preference data: JSONL pairs of answers to one prompt, rendered as instruction data is.

Each line holds the prompt as ``"prompt": str`` or as a conversation (``"messages"``, or
``"prompt"`` as a list of messages: TRL's conversational form), and two answers ``"chosen"`` and
``"rejected"``, each a string or a one-message list ``[{"role": "assistant", "content": ...}]``.
A plain prompt is followed by the answer and EOS, as a prompt/completion example (instruct.py); a
conversation goes through the chat template (data.chat_template, else model.init's): the prompt is
the conversation with the generation prompt, the answer what the template adds for the assistant
turn. Prompt and answer are tokenized one by one and concatenated; labels are -100 on the prompt.

data.source "sorting" is a synthetic task (sorting_pairs, sized by data.synthetic): prefer the
sorted letters to the same letters shuffled.

Batches hold 2 rows per pair, the chosen answer's row then the rejected one's (``chosen`` marks
them), so any split of the rows into micro-batches or ranks keeps each pair whole.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .batches import IGNORE, Batch
from .data import _check_path
from .instruct import Example, InstructBatches, InstructData, _render, held_out, read_examples, template_for
from .tokenizers import TextTokenizer, build_tokenizer, pretrained_tokenizer

Pair = tuple[np.ndarray, np.ndarray, np.ndarray]  # (prompt ids, chosen answer ids, rejected answer ids)
FORMAT = '{"prompt": str or "messages": [...], "chosen": str, "rejected": str}'


@dataclass
class PreferenceData:
    tokenizer: TextTokenizer
    train: list[Pair]
    val: list[Pair]


def _messages(value, path: Path, n: int, field: str) -> list[dict]:
    if not (isinstance(value, list) and value):
        raise ValueError(f"{path}:{n}: '{field}' must be a non-empty list of messages, got {value!r}")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{path}:{n}: each message in '{field}' needs string fields 'role' and 'content': {m!r}")
    return value


def _answer(obj: dict, field: str, path: Path, n: int) -> str:
    if field not in obj:
        raise ValueError(f"{path}:{n}: missing '{field}'; each line needs {FORMAT}")
    value = obj[field]
    if isinstance(value, list) and len(value) == 1:  # [{"role": "assistant", "content": ...}]
        (m,) = _messages(value, path, n, field)
        if m["role"] != "assistant":
            raise ValueError(f"{path}:{n}: '{field}' as a message must have role 'assistant', got {m['role']!r}")
        value = m["content"]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path}:{n}: '{field}' must be a non-empty string or one assistant message, got {value!r}")
    return value


def checked(obj, path: Path, n: int) -> dict:
    """One line as {"prompt": str} or {"messages": [...]} plus "chosen" and "rejected" strings."""
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object {FORMAT}, got {type(obj).__name__}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f"{path}:{n}: needs exactly one of 'prompt' and 'messages' (got {sorted(obj)}); {FORMAT}")
    chosen, rejected = _answer(obj, "chosen", path, n), _answer(obj, "rejected", path, n)
    if chosen == rejected:
        raise ValueError(f"{path}:{n}: 'chosen' and 'rejected' are the same text ({chosen[:60]!r}): nothing to prefer")
    prompt = obj.get("prompt", obj.get("messages"))
    if isinstance(prompt, str):
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    field = "prompt" if "prompt" in obj else "messages"
    return {"messages": _messages(prompt, path, n, field), "chosen": chosen, "rejected": rejected}


def texts(example: dict, template) -> tuple[str, str, str]:
    """(prompt, chosen answer, rejected answer) as the model reads them."""
    if "prompt" in example:
        return example["prompt"], example["chosen"], example["rejected"]
    messages = example["messages"]
    before = _render(template, messages, True)
    answers = []
    for answer in (example["chosen"], example["rejected"]):
        through = _render(template, [*messages, {"role": "assistant", "content": answer}], False)
        if not through.startswith(before):
            raise ValueError(
                "the chat template does not render the conversation with the generation prompt as a prefix of "
                "the conversation with the answer, so the answer cannot be located; use plain prompt data instead"
            )
        answers.append(through[len(before) :])
    return before, *answers


def encode(example: dict, template, tok: TextTokenizer) -> Pair:
    prompt, chosen, rejected = texts(example, template)
    # A plain answer ends in EOS (the model learns to stop), as a prompt/completion example does.
    eos = [tok.eos_id] if "prompt" in example and tok.eos_id is not None else []
    ids = [np.asarray(tok.encode(t), dtype=np.int64) for t in (prompt, chosen, rejected)]
    return ids[0], np.concatenate([ids[1], eos]).astype(np.int64), np.concatenate([ids[2], eos]).astype(np.int64)


def sorting_pairs(n: int, *, min_len: int, max_len: int, alphabet: str, seed: int) -> list[dict]:
    """The synthetic preference task of the dpo-tiny recipe: letters, then the preferred answer is
    them sorted, the rejected one the same letters in another (shuffled) order."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        letters = [rng.choice(alphabet) for _ in range(rng.randint(max(2, min_len), max_len))]
        chosen, shuffled = "".join(sorted(letters)), letters[:]
        rng.shuffle(shuffled)
        if "".join(shuffled) != chosen:
            out.append({"prompt": "".join(letters) + ":", "chosen": chosen, "rejected": "".join(shuffled)})
    return out


def read_source(recipe) -> tuple[list[dict], Path | None]:
    d = recipe.data
    if d.source == "sorting":  # held out: the last n_val pairs
        s = d.synthetic
        shape = {k: s[k] for k in ("min_len", "max_len", "alphabet", "seed")}
        return sorting_pairs(s["n_train"] + s["n_val"], **shape), None
    path = _check_path(d.source)
    return read_examples(path, checked, "preference pairs"), path


def prepare(recipe, tokenizer_json: str | None) -> PreferenceData:
    """Read, render and tokenize data.source (small files: nothing is cached)."""
    examples, path = read_source(recipe)
    template = template_for(recipe, examples)
    rendered = [texts(e, template) for e in examples]
    if tokenizer_json is not None:
        tok = pretrained_tokenizer(tokenizer_json)
    else:  # from scratch: a tokenizer over everything the model will read
        tok = build_tokenizer(recipe.data.tokenizer, "".join(t for r in rendered for t in r),
                              vocab_size=recipe.data.bpe_vocab_size)  # fmt: skip
    encoded = [encode(e, template, tok) for e in examples]
    if path is None:
        held = [i >= recipe.data.synthetic["n_train"] for i in range(len(encoded))]
    else:
        held = held_out(len(encoded))
    return PreferenceData(tok, [e for e, h in zip(encoded, held) if not h], [e for e, h in zip(encoded, held) if h])


def rows(pair: Pair) -> list[Example]:
    """A pair's two rows as instruction examples (ids, labels): prompt + chosen, then prompt +
    rejected, with labels -100 on the prompt."""
    prompt, *answers = pair
    return [(np.concatenate([prompt, a]), np.concatenate([np.full(len(prompt), IGNORE), a])) for a in answers]


class PreferenceBatches(InstructBatches):
    """Pairs drawn with replacement as a pure function of (seed, step), each giving its two rows
    (``rows``) collated as instruction examples are: right-padded to the longest row of the batch
    and cut to seq_len + 1 tokens; ``chosen`` marks each pair's first row."""

    def __init__(self, data: PreferenceData, *, batch_size: int, seq_len: int, seed: int) -> None:
        if not data.train or not data.val:
            raise ValueError("preference data needs at least one training and one validation pair")
        as_rows = InstructData(data.tokenizer, [r for p in data.train for r in rows(p)],
                               [r for p in data.val for r in rows(p)])  # fmt: skip
        super().__init__(as_rows, batch_size=batch_size, seq_len=seq_len, seed=seed)  # warns of rows cut short
        self.data = data  # batches draw and evaluate whole pairs

    def collate(self, pairs: list[Pair]) -> Batch:
        batch = super().collate([r for p in pairs for r in rows(p)])
        return {**batch, "chosen": torch.arange(2 * len(pairs)) % 2 == 0}  # (2P,)
