"""Instruction data: JSONL conversations or prompt/completion pairs, loss on the answers only.

Each line is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ``{"prompt": ...,
"completion": ...}``. Conversations are rendered with a chat template (data.chat_template, else
model.init's, found and sandboxed as the server does: text/chat_template.py); each assistant turn is the
text the template adds between the conversation before it (with the generation prompt) and the
conversation including it, so the labels cover exactly what the model must learn to write.
Prompt/completion pairs use the plain format prompt + completion + EOS. Segments are tokenized
one by one and concatenated; labels are -100 on everything but answer tokens (and the EOS that
ends a completion), and train.py divides by the real answer-token count of the global batch.

With data.pack, examples share rows instead of being padded one per row (PackedInstructBatches):
each is one document, so attention and positions stay inside it and its loss is the loss it has
alone; only the unfilled tail of a row is padding.
"""

from __future__ import annotations

import json
import warnings
from bisect import bisect_left, insort
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..text.chat_template import ChatTemplate, TemplateRefused, load_chat_template
from .batches import IGNORE, Batch, generator
from .corpus import VAL_EVERY, VAL_OFFSET
from .data import _check_path, _lines
from .finetune import init_of
from .tokenizers import TextTokenizer, build_tokenizer, pretrained_tokenizer

Example = tuple[np.ndarray, np.ndarray]  # (ids, labels) of one conversation


@dataclass
class InstructData:
    tokenizer: TextTokenizer
    train: list[Example]
    val: list[Example]


def read_examples(path: Path, checked=None, what: str = "examples") -> list[dict]:
    """The JSONL lines of ``path``, each through ``checked(obj, path, line number)`` (default:
    conversations or prompt/completion pairs; preference_data.py passes its own)."""
    out = []
    for n, line in _lines(path):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from None
        out.append((checked or _checked)(obj, path, n))
    if len(out) < 2:
        raise ValueError(f"data.source={str(path)!r} holds {len(out)} {what}: need at least 2 (train and validation)")
    return out


def held_out(n: int) -> list[bool]:
    """Which of n examples are validation: every 10th, or the last one when there are fewer than 10."""
    if n >= VAL_EVERY:
        return [i % VAL_EVERY == VAL_OFFSET for i in range(n)]
    return [i == n - 1 for i in range(n)]


def _checked(obj, path: Path, n: int) -> dict:
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
        for m in obj["messages"]:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"{path}:{n}: every message needs string fields 'role' and 'content', got {m!r}")
        if not any(m["role"] == "assistant" for m in obj["messages"]):
            raise ValueError(f"{path}:{n}: the conversation has no 'assistant' message: nothing to learn")
        return obj
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
        return obj
    raise ValueError(f'{path}:{n}: expected {{"messages": [...]}} or {{"prompt": str, "completion": str}}')


def segments(example: dict, template) -> list[tuple[str, bool]]:
    """(text, is_answer) pieces whose concatenation is the rendered example."""
    if "messages" not in example:
        return [(example["prompt"], False), (example["completion"], True)]
    messages, out, done = example["messages"], [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(template, messages[:i], True)
        through = _render(template, messages[: i + 1], False)
        if not (before.startswith(done) and through.startswith(before)):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its continuation, so "
                "the assistant turns cannot be located; use prompt/completion data instead"
            )
        out += [(before[len(done) :], False), (through[len(before) :], True)]
        done = through
    rest = _render(template, messages, False)[len(done) :]
    return out + ([(rest, False)] if rest else [])


def _render(template, messages: list[dict], generation_prompt: bool) -> str:
    try:  # text/chat_template.py's sandboxed template, with the generation prompt chosen per call
        return template.render(messages, add_generation_prompt=generation_prompt)
    except TemplateRefused as err:
        raise ValueError(f"the chat template refused a conversation: {err.__cause__}") from None


def encode(example: dict, template, tok: TextTokenizer, eos: int | None) -> Example:
    ids, labels = [], []
    for text, answer in segments(example, template):
        piece = tok.encode(text)
        ids.append(piece)
        labels.append(piece if answer else np.full(len(piece), IGNORE))
    if "messages" not in example and eos is not None:  # a completion ends: the model learns to stop
        ids.append(np.array([eos]))
        labels.append(np.array([eos]))
    return np.concatenate(ids).astype(np.int64), np.concatenate(labels).astype(np.int64)


def load_template(recipe, init: str | None):
    path = recipe.data.chat_template
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"data.chat_template={path!r}: no such file (a jinja2 chat template)")
        return ChatTemplate(file.read_text(encoding="utf-8"))
    return load_chat_template(init) if init is not None else None


def template_for(recipe, examples: list[dict]):
    """The chat template the examples are rendered with (None: plain prompts need none); an error
    when they hold conversations and there is none."""
    template = load_template(recipe, init_of(recipe))
    if template is None and any("messages" in e for e in examples):
        raise ValueError(
            f'data.source={recipe.data.source!r} holds conversations ("messages") but there is no chat template: '
            "set data.chat_template to a jinja2 file, or start from a model.init folder with chat_template.jinja "
            "or a chat_template in tokenizer_config.json (prompt/completion data needs none)"
        )
    return template


def prepare(recipe, tokenizer_json: str | None) -> InstructData:
    """Read, render and tokenize data.source (small files: nothing is cached)."""
    path = _check_path(recipe.data.source)
    examples = read_examples(path)
    template = template_for(recipe, examples)
    if tokenizer_json is not None:
        tok = pretrained_tokenizer(tokenizer_json)
    else:  # from scratch: a char tokenizer over everything the model will read
        text = "".join(t for e in examples for t, _ in segments(e, template))
        tok = build_tokenizer(recipe.data.tokenizer, text, vocab_size=recipe.data.bpe_vocab_size)
    eos = tok.eos_id
    encoded = [encode(e, template, tok, eos) for e in examples]
    held = held_out(len(encoded))
    return InstructData(tok, [e for e, h in zip(encoded, held) if not h], [e for e, h in zip(encoded, held) if h])


class InstructBatches:
    """Examples drawn with replacement as a pure function of (seed, step), right-padded to the
    longest in the batch and cut to seq_len + 1 tokens: ids = x[:-1], labels = y[1:]."""

    def __init__(self, data: InstructData, *, batch_size: int, seq_len: int, seed: int) -> None:
        if not data.train or not data.val:
            raise ValueError("instruction data needs at least one training and one validation example")
        self.data, self.batch_size, self.seq_len, self.seed = data, batch_size, seq_len, seed
        tok = data.tokenizer
        self.pad = next((i for i in (tok.pad_id, tok.eos_id) if i is not None), 0)
        long = [labels for ids, labels in data.train + data.val if len(ids) > seq_len + 1]
        if long:
            lost = sum(bool((labels[1 : seq_len + 1] == IGNORE).all()) for labels in long)
            warnings.warn(
                f"{len(long)} instruction examples are longer than data.seq_len + 1 = {seq_len + 1} tokens and are "
                f"cut there ({lost} of them keep no answer token); raise data.seq_len to keep them whole",
                stacklevel=2,
            )

    def collate(self, examples: list[Example]) -> Batch:
        L = min(self.seq_len + 1, max(len(ids) for ids, _ in examples))
        ids = np.full((len(examples), L), self.pad, dtype=np.int64)  # (B, T + 1)
        labels = np.full((len(examples), L), IGNORE, dtype=np.int64)  # (B, T + 1)
        for row, (x, y) in enumerate(examples):
            ids[row, : min(L, len(x))], labels[row, : min(L, len(y))] = x[:L], y[:L]
        ids_t, labels_t = torch.from_numpy(ids), torch.from_numpy(labels)
        return {"ids": ids_t[:, :-1], "labels": labels_t[:, 1:]}

    def batch(self, step: int) -> Batch:
        picks = torch.randint(0, len(self.data.train), (self.batch_size,), generator=generator(self.seed, step, 0))
        return self.collate([self.data.train[i] for i in picks.tolist()])

    def eval_batches(self, n: int) -> list[Batch]:
        val = self.data.val
        chunks = [val[i : i + self.batch_size] for i in range(0, len(val), self.batch_size)]
        return [self.collate(c) for c in chunks[:n]]


def shifted(example: Example, seq_len: int) -> Example:
    """(inputs, targets) = (ids[:-1], labels[1:]) of one example, cut to seq_len: the shift is
    made inside the example, so no target of a packed row is the first token of the next one."""
    ids, labels = example
    return ids[:-1][:seq_len], labels[1:][:seq_len]


def pack(lengths: list[int], seq_len: int, order) -> list[list[int]]:
    """Best fit, greedily in ``order``: each example goes whole into the open row with the least
    room that still holds it, else into a new row. Returns the example indices of each row."""
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row index) of the rows not yet full, sorted
    for i in order:
        n = lengths[i]
        if n == 0:  # a one-token example has no (input, target) pair: nothing to learn
            continue
        k = bisect_left(rooms, (n, -1))
        if k < len(rooms):
            room, r = rooms.pop(k)
        else:
            room, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            insort(rooms, (room - n, r))
    return rows


class PackedInstructBatches(InstructBatches):
    """data.instruct + data.pack: rows of exactly seq_len tokens, each holding whole examples
    (``shifted``, so an example longer than seq_len + 1 tokens is cut, as unpacked) packed best
    fit in a seeded order, once. Each example is one document (document_ids 0, 1, ... along the
    row): the model keeps attention inside it and restarts its positions, so its logits are those
    it has alone. The unfilled tail is padding: pad ids, labels -100, a document id of its own.
    Rows are served in a fresh seeded order each epoch; the j-th row of step s is row s * B + j of
    that stream of epochs, a pure function of (seed, step) that shows every row once per epoch."""

    def __init__(self, data: InstructData, *, batch_size: int, seq_len: int, seed: int) -> None:
        super().__init__(data, batch_size=batch_size, seq_len=seq_len, seed=seed)
        self.train_pairs = [shifted(e, seq_len) for e in data.train]
        self.val_pairs = [shifted(e, seq_len) for e in data.val]
        order = torch.randperm(len(data.train), generator=generator(seed, 0, 4)).tolist()
        self.train_rows = pack([len(x) for x, _ in self.train_pairs], seq_len, order)
        self.val_rows = pack([len(x) for x, _ in self.val_pairs], seq_len, range(len(data.val)))
        if not self.train_rows or not self.val_rows:
            raise ValueError("instruction data: no example has two tokens or more (nothing to learn from)")
        self._order: tuple[int, list[int]] = (-1, [])

    def collate_rows(self, pairs: list[Example], rows: list[list[int]]) -> Batch:
        B, T = len(rows), self.seq_len
        ids = np.full((B, T), self.pad, dtype=np.int64)  # (B, T)
        labels = np.full((B, T), IGNORE, dtype=np.int64)  # (B, T)
        docs = np.empty((B, T), dtype=np.int64)  # (B, T)
        for b, row in enumerate(rows):
            at = 0
            for d, i in enumerate(row):
                x, y = pairs[i]
                ids[b, at : at + len(x)], labels[b, at : at + len(x)], docs[b, at : at + len(x)] = x, y, d
                at += len(x)
            docs[b, at:] = len(row)  # the padding tail: a document of its own that nothing attends to
        out = {"ids": ids, "labels": labels, "document_ids": docs}
        return {k: torch.from_numpy(v) for k, v in out.items()}

    def epoch_order(self, epoch: int) -> list[int]:
        if self._order[0] != epoch:  # a batch reads one epoch's order, two where it straddles them
            perm = torch.randperm(len(self.train_rows), generator=generator(self.seed, epoch, 3))
            self._order = (epoch, perm.tolist())
        return self._order[1]

    def batch(self, step: int) -> Batch:
        n = len(self.train_rows)
        where = [divmod(r, n) for r in range(step * self.batch_size, (step + 1) * self.batch_size)]
        return self.collate_rows(self.train_pairs, [self.train_rows[self.epoch_order(e)[k]] for e, k in where])

    def eval_batches(self, n: int) -> list[Batch]:
        rows = self.val_rows
        chunks = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        return [self.collate_rows(self.val_pairs, c) for c in chunks[:n]]
