"""`torchformer demo`: the main job. The default trains the shakespeare-char recipe (under 5
minutes on 2 CPU cores) and prints a 300-character sample; `torchformer demo reverse` trains the
vanilla encoder-decoder on sequence reversal, reports held-out exact match and prints one
example's cross-attention as ASCII (the anti-diagonal a reversal needs)."""

from __future__ import annotations

import argparse

import torch

DEMOS = ("shakespeare", "reverse")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "words", nargs="*", help=f"which demo, one of {list(DEMOS)} (default shakespeare), then dotted recipe overrides"
    )


def run(args: argparse.Namespace) -> int:
    """Train the default model and sample from it, or (`reverse`) the encoder-decoder demo."""
    from . import train as train_cli

    words = list(args.words)
    which = words.pop(0) if words and "=" not in words[0] else "shakespeare"
    if which not in DEMOS:
        raise ValueError(f"demo {which!r}: choose one of {list(DEMOS)}")
    recipe = "shakespeare-char" if which == "shakespeare" else "reverse"
    ns = train_cli.parse(["--recipe", recipe, "--", *words])
    if which == "shakespeare":
        return train_cli.run(ns)
    return reverse(ns)


def reverse(ns: argparse.Namespace) -> int:
    from ..training.recipe import load
    from ..training.reverse_eval import cross_attention_ascii, exact_match
    from ..training.train import train
    from .train import BarReporter

    result = train(load(ns.recipe, ns.overrides), reporter=BarReporter())
    pairs = result.data.val
    acc, examples = exact_match(result.model, result.tokenizer, pairs)
    print(f"held-out exact match: {100 * acc:.1f}% of {len(pairs)} reversals (greedy decoding)")
    for src, want, got in examples[:3]:
        print(f"  {src!r:>16} -> {got!r:<16} {'ok' if got == want else 'expected ' + repr(want)}")
    src = examples[0][0]
    with torch.no_grad():
        print(f"\ncross-attention of the last decoder layer for {src!r} (rows: output, columns: input):")
        print(cross_attention_ascii(result.model, result.tokenizer, src))
    return 0
