"""`torchformer train`: run a training recipe (YAML) with dotted overrides."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..extras import require
from ..training.recipe import load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default=None, help="recipe YAML file or packaged name (default: shakespeare-char)")
    p.add_argument("--data", default=None, help="data source: a text file, a folder, JSONL or TSV (sets data.source)")
    p.add_argument("--out", default=None, help="run folder (sets train.out_dir)")
    p.add_argument("--device", default=None, help="cpu | cuda | mps | auto (sets train.device)")
    p.add_argument("--resume", default=None, help="'auto' (latest checkpoint in the run folder) or a checkpoint folder")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layers=4 optim.lr=3e-4 train.steps=200")
    # Not an option: accepted only to explain why (generate / serve / convert take --quantize).
    p.add_argument("--quantize", default=None, help=argparse.SUPPRESS)


def parse(argv: list[str]) -> argparse.Namespace:
    """`argv` as `torchformer train` reads it: one parser and its defaults for every entry point that trains
    (`demo` builds its arguments here, so a new option of `train` can never be missing from them)."""
    from .main import parse as parse_command

    return parse_command("train", argv)


class BarReporter:
    """Progress bar with step, loss, lr, tokens/s and MFU; evaluation lines with loss and perplexity."""

    def __init__(self) -> None:
        self.bar = None

    def start(self, info) -> None:
        tqdm = require("tqdm").tqdm

        print(
            f"{info['recipe']}: {info['params']:,} parameters on {info['device']} (world {info['world']}), "
            f"matmul peak {info['peak_gflops']:.0f} GFLOP/s, run folder {info['out_dir']}"
        )
        self.bar = tqdm(total=info["steps"], initial=info["start"], unit="step", dynamic_ncols=True, file=sys.stdout)

    def step(self, info) -> None:
        self.bar.update(info["step"] - self.bar.n)
        moe = f" balance {info['balance_loss']:.3f} z {info['z_loss']:.2f}" if "balance_loss" in info else ""
        self.bar.set_postfix_str(
            f"loss {info['loss']:.3f} lr {info['lr']:.2e} {info['tok_s']:,.0f} tok/s MFU {100 * info['mfu']:.0f}%{moe}"
        )

    def evaluate(self, row) -> None:
        train = "   -  " if row["train_loss"] is None else f"{row['train_loss']:.4f}"
        self.bar.write(
            f"step {row['step']:>6}: train {train}  val {row['val_loss']:.4f}  "
            f"ppl {row['val_ppl']:.2f}  ({row['elapsed_s']:.0f} s)"
        )

    def message(self, text: str) -> None:
        (self.bar.write if self.bar else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    """Train a model from a recipe.

    Examples:
      torchformer train                                   # Shakespeare, char-level (the default run)
      torchformer train --recipe reverse                  # encoder-decoder on sequence reversal
      torchformer train --recipe mlm-tiny --data corpus/  # masked LM on your text
      torchformer train train.steps=200 model.n_layers=2 optim.lr=1e-3
      torchformer train --resume auto                     # continue from the latest checkpoint
      torchrun --nproc_per_node 2 -m torchformer.cli.main train --recipe shakespeare-char
    """
    from ..training.train import NonFiniteLoss, train

    if args.quantize is not None:
        raise ValueError(
            f"--quantize {args.quantize}: weight-only quantized weights cannot be trained; train the float "
            "model and quantize it afterwards (generate / serve / convert --quantize), or train LoRA adapters "
            f"over a quantized base (finetune.lora plus finetune.quantize={args.quantize}, or model.init=a "
            "quantized checkpoint)"
        )
    overrides = list(args.overrides)
    for flag, key in ((args.data, "data.source"), (args.out, "train.out_dir"), (args.device, "train.device")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    recipe = load(args.recipe, overrides)
    started = time.perf_counter()
    try:
        result = train(recipe, resume=args.resume, reporter=BarReporter())
    except NonFiniteLoss as err:
        print(f"torchformer train: stopped: {err}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(f"done: step {result.step}, val loss {result.val_loss:.4f} in {time.perf_counter() - started:.0f} s; "
          f"model in {result.out_dir}")  # fmt: skip
    if recipe.train.sample_chars and recipe.data.task == "lm":
        from ..training.sample import sample_text

        # train() made it already when trackers were sent it (train.log_to); the same call otherwise.
        text = result.sample or sample_text(result.model, result.tokenizer, recipe.train.sample_prompt,
                                            recipe.train.sample_chars, temperature=recipe.train.sample_temperature,
                                            seed=recipe.train.seed)  # fmt: skip
        print("-" * 72 + "\n" + text + "\n" + "-" * 72)
    return 0
