"""What the one torchrun launch of tp_worker.py runs besides the grid, built in the test process:
a saved model for ``generate --tp 2`` with its single-process tokens, and the recipe of a TP=2
training run."""

from __future__ import annotations

import dataclasses

import torch

import torchformer as tfm
from tests.decoding import assert_varied, varied_case

from ..training.tiny import tiny_recipe, words_text
from .tp_worker import GRID, V, build

STEPS = {"steps": 2, "batch_size": 8, "eval_every": 2, "eval_batches": 1}


def train_recipe(tmp_path, name, **dist):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(words_text(400))
    return tiny_recipe(tmp_path / name, corpus, train=STEPS, dist=dist)


def generate_case(folder) -> tuple[str, list[int]]:
    """(prompt ids as --ids takes them, prompt + 16 greedy tokens of one process) for a model saved
    to ``folder`` whose greedy continuation is varied."""
    cfg = dataclasses.replace(GRID["gqa-swiglu-untied-bias"], init_std=0.5)
    candidates = torch.randint(0, V, (12, 5), generator=torch.Generator().manual_seed(2))
    model, prompt = varied_case(lambda s: build(cfg, s), candidates, 16, 8, seeds=range(6))
    tfm.save(model, folder)
    want = tfm.generate(model, prompt, max_new_tokens=16)[0].tolist()
    assert_varied(want[-16:], 8)
    return ",".join(map(str, prompt[0].tolist())), want
