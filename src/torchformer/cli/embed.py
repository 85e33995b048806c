"""`torchformer embed`: sentence embeddings from an encoder folder (e.g. a sentence-transformers
model), one JSON line per text; --similarity prints the cosine matrix instead."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an encoder folder with tokenizer.json (HF / sentence-transformers, or torchformer)")
    p.add_argument("--text", action="append", default=[], help="a text to embed (repeat for more)")
    p.add_argument("--file", default=None, help="a UTF-8 file with one text per line")
    p.add_argument("--pooling", default=None, help="mean | cls | max | mean_sqrt_len (default: the folder's)")
    p.add_argument("--no-normalize", action="store_true", help="skip the L2 normalisation")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--similarity", action="store_true", help="print the cosine similarity matrix of the texts")


def run(args: argparse.Namespace) -> int:
    """Embed texts with MODEL: pool the final hidden states over real tokens (the folder's
    1_Pooling/config.json, else mean) and L2-normalise, as sentence-transformers does. Prints
    {"text", "embedding"} per line, or with --similarity {"similarity": [[...]]}."""
    from ..evaluation.embed import embed
    from ..training.data import read_utf8

    texts = list(args.text)
    if args.file is not None:
        texts += [line for line in read_utf8(Path(args.file)).splitlines() if line.strip()]
    if not texts:
        raise ValueError("give at least one --text or a --file with one text per line")
    vectors = embed(
        args.model,
        texts,
        pooling=args.pooling,
        normalize=False if args.no_normalize else None,
        batch_size=args.batch_size,
    )
    if args.similarity:
        unit = vectors / vectors.norm(dim=-1, keepdim=True)
        print(json.dumps({"texts": texts, "similarity": (unit @ unit.T).tolist()}))
        return 0
    for text, vector in zip(texts, vectors.tolist()):
        print(json.dumps({"text": text, "embedding": vector}))
    return 0
