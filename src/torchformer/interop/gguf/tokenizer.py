"""tokenizer.ggml.* -> a ``tokenizers.Tokenizer`` that splits text as llama.cpp does, plus the
chat template and the BOS/EOS texts ``serve`` renders it with.

Two models (llama.cpp llama-vocab.cpp):
- ``gpt2``: byte-level BPE. Vocabulary and merges are in the file; the pre-tokenizer (the regex
  that cuts text into words before merging) is named by ``tokenizer.ggml.pre`` and lives in
  llama.cpp's code, so PRE_TOKENIZERS lists those we know: a file naming another is refused.
- ``llama``: SentencePiece BPE with byte fallback. The file has pieces and scores, no merges:
  SentencePiece merges the adjacent pair whose joined piece scores highest, which is a BPE whose
  merges are every split of every piece ranked by that piece's score.
Token types (llama.cpp's): 3 control (special, never parsed from plain text by llama.cpp's
tokenize(special=False)), 4 user-defined (always matched), 6 byte (<0xXX>, SentencePiece's
fallback).
"""

from __future__ import annotations

import os

from ...extras import require
from .container import GGUFFile, open_gguf

CONTROL, USER_DEFINED = 3, 4
# tokenizer.ggml.pre -> (the word-splitting regex, whether a word already in the vocabulary skips
# merging (llama.cpp's ignore_merges)); None: GPT-2's own regex (ByteLevel's built-in one).
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"  # the two differ in digit runs
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3, _QWEN2 = _WORDS + r"\p{N}{1,3}" + _REST, _WORDS + r"\p{N}" + _REST
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "gpt-2": (None, False),
    "default": (None, False),
    "llama-bpe": (_LLAMA3, True),
    "llama3": (_LLAMA3, True),
    "qwen2": (_QWEN2, False),
}
MODELS = ("gpt2", "llama")


def tokenizer_from_gguf(source: str | os.PathLike | GGUFFile):
    """The tokenizer a GGUF file describes (its ``tokenizer.ggml.*`` metadata)."""
    f = source if isinstance(source, GGUFFile) else open_gguf(source)
    kind = f.get("tokenizer.ggml.model")
    if kind not in MODELS:
        raise ValueError(f"{f.path}: tokenizer.ggml.model={kind!r} is not supported; supported: {list(MODELS)}")
    tk = require("tokenizers", extra="gguf")
    tokens = list(f.require("tokenizer.ggml.tokens"))
    types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    tok = _bpe(f, tk, tokens) if kind == "gpt2" else _sentencepiece(f, tk, tokens, types)
    tok.add_tokens(
        [tk.AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    tok.add_special_tokens(
        [tk.AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    )
    bos = f.get("tokenizer.ggml.bos_token_id")
    if f.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        tok.post_processor = tk.processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    return tok


def _bpe(f: GGUFFile, tk, tokens: list[str]):
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{f.path}: tokenizer.ggml.pre={pre!r} is not supported; supported: {list(PRE_TOKENIZERS)}")
    regex, ignore_merges = PRE_TOKENIZERS[pre]
    # Split where llama.cpp does (the first space after the first character); an entry without one is
    # a pair of empty symbols there, which never merges: skipped (our byte and char exports write one).
    merges = [(m[:i], m[i + 1 :]) for m in f.get("tokenizer.ggml.merges") or [] if (i := m.find(" ", 1)) != -1]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)
    split = [] if regex is None else [tk.pre_tokenizers.Split(tk.Regex(regex), behavior="isolated")]
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([*split, byte_level])
    tok.decoder = tk.decoders.ByteLevel()
    return tok


def _sentencepiece(f: GGUFFile, tk, tokens: list[str], types: list[int]):
    scores = list(f.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = f.get("tokenizer.ggml.unknown_token_id")
    model = tk.models.BPE(
        vocab=vocab,
        merges=[(left, right) for *_, left, right in merges],
        unk_token=None if unk is None else tokens[unk],
        byte_fallback=True,
        fuse_unk=True,
    )
    tok = tk.Tokenizer(model)
    space = [tk.normalizers.Prepend("▁")] if f.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.normalizer = tk.normalizers.Sequence([*space, tk.normalizers.Replace(" ", "▁")])
    strip = [tk.decoders.Strip(" ", 1, 0)] if space else []
    tok.decoder = tk.decoders.Sequence(
        [tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse(), *strip]
    )
    return tok


def chat_template_from_gguf(source: str | os.PathLike | GGUFFile) -> tuple[str | None, str, str]:
    """(tokenizer.chat_template or None, the BOS text, the EOS text) for rendering chats."""
    f = source if isinstance(source, GGUFFile) else open_gguf(source)
    tokens = f.get("tokenizer.ggml.tokens") or []
    text = lambda key: tokens[f.get(key)] if f.get(key) is not None and f.get(key) < len(tokens) else ""  # noqa: E731
    return f.get("tokenizer.chat_template"), text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id")
