"""`torchformer eval`: perplexity and bits per byte of a text file (strided sliding window), or
token accuracy and exact match of source/target pairs for an encoder-decoder; or, with --tasks,
lm-evaluation-harness tasks through its ``torchformer`` backend (evaluation/lm_eval_run.py); one
JSON line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..loading import TOKENIZER_FILE, cast, has_tokenizer, load_any, load_tokenizer
from .options import add_dtype, dtype_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder (tfm.save / training) or Hugging Face folder, with tokenizer.json")
    p.add_argument("--data", help="UTF-8 text file (LM); .jsonl source/target or .tsv pairs (seq2seq)")
    p.add_argument("--tasks", help="instead of --data: lm-eval task names, comma-separated (needs torchformer[eval])")
    p.add_argument("--include-path", default=None, help="with --tasks: a folder of your own lm-eval task YAML files")
    p.add_argument("--num-fewshot", type=int, default=None, help="with --tasks: examples in each prompt")
    p.add_argument("--limit", type=float, default=None, help="with --tasks: documents per task (< 1: a fraction)")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None, help="with --tasks: weight-only quantize")
    p.add_argument("--group-size", type=int, default=None, help="with --quantize int4: inputs per scale (default 64)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens of context per window (default: max_seq_len)")
    p.add_argument("--stride", type=int, default=None, help="tokens the window moves (default: seq_len // 2)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder to apply first (tfm.lora.load)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_dtype(p)


def run(args: argparse.Namespace) -> int:
    """Score MODEL on --data and print one JSON line of results.

    Causal LMs: every token after the first is scored once, with windows of --seq-len tokens of
    context moved by --stride (stride = seq-len: back-to-back windows; smaller: more context per
    token, more work); prints loss, perplexity, bits_per_byte. Encoder-decoders: teacher-forced
    token accuracy and exact match (== greedy decoding reproducing the target) over the pairs.
    --dtype scores the model cast to that dtype (the loss is summed in float32 either way).
    --tasks instead runs lm-evaluation-harness tasks through its torchformer backend and prints
    each task's metrics; the task names are checked before the model loads."""
    from ..training.data import read_utf8

    dtype = dtype_of(args)
    if (args.data is None) == (args.tasks is None):
        raise ValueError("give either --data FILE (perplexity) or --tasks NAMES (lm-evaluation-harness), not both")
    if args.tasks is not None:
        return _tasks(args)
    if args.quantize is not None or args.group_size is not None:
        raise ValueError("--quantize and --group-size go with --tasks")
    data = Path(args.data)
    if not data.is_file():
        raise FileNotFoundError(f"--data {args.data!r}: no such file")
    if not isinstance(args.batch_size, int) or args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: must be >= 1")
    if not has_tokenizer(args.model):
        raise ValueError(f"{args.model}: no {TOKENIZER_FILE} beside the model; eval needs it to read --data")
    text = read_utf8(data)  # a file that is not UTF-8 is named with the byte offset, before the model loads
    model, tok = load_any(args.model, dtype=dtype), load_tokenizer(args.model)
    if args.adapter is not None:
        from ..lora import load as load_adapter

        load_adapter(model, args.adapter)
        cast(model, next(model.parameters()).dtype)  # the adapter's new weights in the model's dtype
    model.eval()
    if model.config.arch == "encoder_decoder":
        result = _seq2seq(model, tok, data, args.batch_size)
    elif model.config.arch == "decoder":
        result = _lm(model, tok, text, args, data)
    else:
        raise ValueError(f"{args.model} is an encoder (arch 'encoder'): use `torchformer embed` for it")
    print(json.dumps({"model": str(args.model), "data": str(data), **result}))
    return 0


def _tasks(args: argparse.Namespace) -> int:
    """lm-eval's per-task metrics on one JSON line; task names are checked before the model loads."""
    from ..evaluation.lm_eval_run import evaluate_tasks

    if args.adapter is not None:
        raise ValueError("--adapter is not supported with --tasks yet: merge it first (tfm.lora.merge)")
    if args.group_size is not None and args.quantize != "int4":
        raise ValueError(f"--group-size={args.group_size} needs --quantize int4")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results = evaluate_tasks(
        args.model,
        [t.strip() for t in args.tasks.split(",")],
        include_path=args.include_path,
        num_fewshot=args.num_fewshot,
        limit=limit,
        batch_size=args.batch_size,
        dtype=args.dtype,
        quantize=args.quantize,
        group_size=args.group_size,
    )
    tasks = {name: {k: v for k, v in row.items() if k != "alias"} for name, row in results["results"].items()}
    print(json.dumps({"model": str(args.model), "tasks": tasks}))
    return 0


def _lm(model, tok, text: str, args, data: Path) -> dict:
    from ..evaluation.perplexity import text_perplexity, windows

    seq_len = args.seq_len if args.seq_len is not None else min(model.config.max_seq_len, 1024)
    if seq_len > model.config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len}: the model's max_seq_len is {model.config.max_seq_len}")
    stride = args.stride if args.stride is not None else max(1, seq_len // 2)
    tok.no_padding()
    tok.no_truncation()
    try:
        n_windows = len(windows(len(tok.encode(text, add_special_tokens=False).ids), seq_len, stride))
    except ValueError as err:
        raise ValueError(f"--data {str(data)!r}: {err}") from None
    bar = _bar(n_windows, args.no_progress)
    score = text_perplexity(
        model, _Plain(tok), text, seq_len=seq_len, stride=stride, batch_size=args.batch_size, progress=bar.update
    )
    bar.close()
    return {"seq_len": seq_len, "stride": stride, **score.to_dict()}


class _Plain:
    """A tokenizers.Tokenizer that adds no special tokens: the file is scored as it is."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def _seq2seq(model, tok, data: Path, batch_size: int) -> dict:
    from ..evaluation.perplexity import seq2seq_accuracy
    from ..training.batches import PairBatches
    from ..training.data import _json_field, _lines

    if data.suffix == ".jsonl":
        pairs = [
            (_json_field(line, ("source", "src"), data, n), _json_field(line, ("target", "tgt"), data, n))
            for n, line in _lines(data)
        ]
    elif data.suffix == ".tsv":
        pairs = [tuple(line.rstrip("\n").split("\t", 1)) for _, line in _lines(data)]
    else:
        raise ValueError(f"--data {str(data)!r}: pairs for an encoder-decoder must be a .jsonl or .tsv file")
    cfg = model.config
    ids = [[tok.encode(s, add_special_tokens=False).ids, tok.encode(t, add_special_tokens=False).ids] for s, t in pairs]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    maker = PairBatches(
        ids,
        ids,
        batch_size=min(batch_size, len(ids)),
        seed=0,
        pad=pad,
        bos=cfg.decoder_start_token_id,
        eos=cfg.eos_token_id,
    )
    chunks = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
    with torch.no_grad():
        return seq2seq_accuracy(model, (maker.collate(c) for c in chunks))


def _bar(total: int, off: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="window", disable=off, file=sys.stderr, leave=False)
