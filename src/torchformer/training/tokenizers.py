"""Tokenizers for training: char, byte and BPE, all saved as Hugging Face ``tokenizers`` JSON.

The saved tokenizer.json is what ``tfm.load_tokenizer`` and ``torchformer generate`` read. For
char and byte the training data is encoded with a numpy lookup that gives the same ids as the
HF tokenizer (a test checks it) but runs ~100x faster on a 5 MB corpus; BPE uses HF's batch encode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..extras import require
from ..text.byte_level import byte_alphabet

SPECIALS = ("<pad>", "<s>", "</s>", "<mask>", "<unk>")
KINDS = ("char", "byte", "bpe")


@dataclass
class TextTokenizer:
    """A HF ``tokenizers.Tokenizer`` plus the special-token ids training needs."""

    kind: str
    hf: object  # tokenizers.Tokenizer
    chars: str = ""  # char kind: the alphabet in id order (after the specials)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        return self.hf.token_to_id(token)

    @property
    def pad_id(self) -> int:
        return self.token_id("<pad>")

    @property
    def bos_id(self) -> int:
        return self.token_id("<s>")

    @property
    def eos_id(self) -> int:
        return self.token_id("</s>")

    @property
    def mask_id(self) -> int:
        return self.token_id("<mask>")

    def ordinary_ids(self) -> tuple[int, int]:
        """[lo, hi) of the ids that are not special tokens (MLM draws its random tokens there)."""
        return (0, 256) if self.kind == "byte" else (len(SPECIALS), self.vocab_size)

    def encode(self, text: str) -> np.ndarray:
        """text -> int64 ids (no special tokens added)."""
        if self.kind == "byte":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        if self.kind == "char":
            return self._encode_chars(text)
        if self.kind == "pretrained":  # a model's own tokenizer: its template adds BOS/EOS where it wants them
            return np.array(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        lines = text.splitlines(keepends=True)
        return np.fromiter((i for enc in self.hf.encode_batch(lines) for i in enc.ids), dtype=np.int64)

    def _encode_chars(self, text: str) -> np.ndarray:
        # One gather from a table indexed by code point (at most 0x10FFFF + 1 entries, 8.9 MB): a binary
        # search of the alphabet per character took 1.5 s on the default corpus's 4.2M characters, this 0.03 s.
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        alphabet = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        table = np.full(max(codes.max(initial=0), alphabet.max(initial=0)) + 1, self.token_id("<unk>"), np.int64)
        table[alphabet] = np.arange(len(SPECIALS), len(SPECIALS) + len(alphabet))
        return table[codes]

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_json(self) -> str:
        return self.hf.to_str(pretty=True)


def build_tokenizer(kind: str, text: str, *, vocab_size: int = 4096) -> TextTokenizer:
    """A tokenizer of ``kind`` (char | byte | bpe) fitted to ``text`` (char: its alphabet; bpe: trained)."""
    tk = require("tokenizers")
    Regex, Tokenizer, decoders, models = tk.Regex, tk.Tokenizer, tk.decoders, tk.models
    pre_tokenizers, trainers = tk.pre_tokenizers, tk.trainers

    if kind not in KINDS:
        raise ValueError(f"data.tokenizer={kind!r}: must be one of {list(KINDS)}")
    if kind == "char":
        chars = "".join(sorted(set(text)))
        vocab = {t: i for i, t in enumerate(SPECIALS)} | {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char a token
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens(list(SPECIALS))
        return TextTokenizer("char", hf, chars)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind == "bpe")
    if kind == "byte":
        # id == byte value: a BPE over the 256 byte symbols with no merges.
        hf = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_alphabet())}, merges=[]))
    else:
        hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = byte_level
    hf.decoder = decoders.ByteLevel()
    if kind == "bpe":
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=byte_alphabet(), show_progress=False
        )
        hf.train_from_iterator(text.splitlines(keepends=True), trainer)
    hf.add_special_tokens(list(SPECIALS))
    return TextTokenizer(kind, hf)


def pretrained_tokenizer(json_text: str) -> TextTokenizer:
    """The tokenizer.json of a model to fine-tune: our own char tokenizer keeps its fast path;
    any other (a Hugging Face model's) is used as it is, kind "pretrained"."""
    model = json.loads(json_text).get("model", {})
    char = model.get("type") == "WordLevel" and all(s in model.get("vocab", {}) for s in SPECIALS)
    return load_text_tokenizer("char" if char else "pretrained", json_text)


def load_text_tokenizer(kind: str, json_text: str) -> TextTokenizer:
    """Rebuild a tokenizer saved with ``to_json`` (resume, cached data)."""
    hf = require("tokenizers").Tokenizer.from_str(json_text)
    chars = ""
    if kind == "char":
        vocab = hf.get_vocab(with_added_tokens=False)
        ordered = sorted((i, t) for t, i in vocab.items() if t not in SPECIALS)
        chars = "".join(t for _, t in ordered)
    return TextTokenizer(kind, hf, chars)
