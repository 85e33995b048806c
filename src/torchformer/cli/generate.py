"""`torchformer generate`: continue a prompt with a checkpoint, a Hugging Face folder or a preset."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from ..generation.generate import stream
from ..loading import TOKENIZER_FILE, has_tokenizer, load_any, load_tokenizer
from .options import add_dtype, dtype_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint folder (tfm.save / training), Hugging Face folder or preset name")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text, encoded with the tokenizer.json saved beside the checkpoint")
    source.add_argument("--ids", help="comma-separated token ids, e.g. 1,2,3 (when there is no tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--no-repeat-ngram-size", type=int, default=0)
    p.add_argument("--eos-id", type=int, default=None, help="stop at this id (default: the config's eos_token_id)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (on the CPU ahead of time, kept on disk: a first run compiles, later ones load)",
    )
    p.add_argument("--verbose", action="store_true", help="print prefill time, tokens/s (and acceptance) at the end")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None, help="weight-only quantize before generating")
    p.add_argument("--group-size", type=int, default=None, help="with --quantize int4: inputs per scale (default 64)")
    add_dtype(p)
    guess = p.add_mutually_exclusive_group()
    guess.add_argument("--draft", metavar="MODEL", help="speculative decoding with this draft (folder or preset)")
    guess.add_argument("--prompt-lookup", type=int, metavar="K", help="speculative: K tokens by prompt lookup")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="with --draft: tokens guessed per round (3)")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallel over N processes: torchrun --nproc_per_node N -m torchformer.cli.main ...",
    )


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--ids {text!r}: must be comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise ValueError(f"--ids {text!r}: give at least one token id")
    return ids


def tokenizer_for(spec: str, needed: bool):
    folder = Path(spec)
    if has_tokenizer(folder):  # a folder's tokenizer.json or a .gguf file's own
        return load_tokenizer(folder)
    if needed:
        raise ValueError(f"--prompt needs a {TOKENIZER_FILE} in the checkpoint folder; {spec} has none: use --ids")
    return None


class Printer:
    """Writes the new text as tokens arrive; holds back an incomplete UTF-8 sequence (byte-level
    BPE can split one character over several tokens)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        if self.tokenizer is None:
            sys.stdout.write(("," if len(self.ids) > 1 else "") + str(token))
        else:
            self.show(final=False)
        sys.stdout.flush()

    def finish(self) -> None:
        """Write what was held back: at the end, an incomplete UTF-8 sequence is what the whole
        decoded text shows too (replacement characters), so streamed and plain output agree."""
        if self.tokenizer is not None and self.ids:
            self.show(final=True)

    def show(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return
        sys.stdout.write(text[len(self.shown) :] if text.startswith(self.shown) else text)
        self.shown = text


def tp_session(args: argparse.Namespace):
    """With --tp N (> 1): the launch checked, the process group up and the TP mesh made; else None."""
    if args.tp == 1:
        return None
    from ..parallel.session import TPSession, check_generate

    check_generate(args.tp, draft=args.draft, prompt_lookup=args.prompt_lookup, quantize=args.quantize,
                   compile=args.compile)  # fmt: skip
    return TPSession.start(args.tp)


def run(args: argparse.Namespace) -> int:
    """Generate from CHECKPOINT given --prompt TEXT (tokenized with the checkpoint's tokenizer.json)
    or --ids 1,2,3. Greedy by default; --temperature/--top-k/--top-p/--min-p sample. For an
    encoder-decoder the prompt is the source and the output is the decoded target. --dtype
    bfloat16|float16|float32 casts the model (and a --draft) before --quantize."""
    dtype = dtype_of(args)
    if args.group_size is not None and args.quantize is None:
        raise ValueError(f"--group-size={args.group_size} needs --quantize int4")
    split = tp_session(args)  # None without --tp
    tokenizer = tokenizer_for(args.checkpoint, needed=args.prompt is not None)
    prompt = tokenizer.encode(args.prompt).ids if args.prompt is not None else parse_ids(args.ids)
    if split is None:
        model = load_any(args.checkpoint, dtype=dtype, quantize=args.quantize, group_size=args.group_size).eval()
    else:  # every rank reads its slice and runs the same steps; rank 0 alone prints
        model = split.load(args.checkpoint, dtype)
        args.seed, quiet = split.seed(args.seed), split.rank != 0
        sys.stdout = open(os.devnull, "w") if quiet else sys.stdout  # noqa: SIM115
    draft = None if args.draft is None else load_any(args.draft, dtype=dtype).eval()
    eos = model.config.eos_token_id if args.eos_id is None else args.eos_id
    seq2seq = hasattr(model, "encode")
    t0 = time.perf_counter()
    tokens = stream(
        model,
        torch.tensor([prompt], device=next(model.parameters()).device),  # a --tp model may sit on a GPU
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        eos_token_id=eos,
        seed=args.seed,
        compile=args.compile,
        draft_model=draft,
        num_draft_tokens=args.num_draft_tokens,
        prompt_lookup_num_tokens=args.prompt_lookup,
    )
    printer = Printer(tokenizer)
    if args.stream and not seq2seq:
        print(args.prompt if args.prompt is not None else args.ids, end="" if args.prompt is not None else ",")
    new, first = [], None
    for tok in tokens:
        first = first or time.perf_counter()
        new.append(tok.tolist()[0])  # the values themselves: int(tok[0]) makes a view first
        if args.stream:
            printer.add(new[-1])
    end = time.perf_counter()
    if args.stream:
        printer.finish()
        print()
    else:
        shown = new if seq2seq else prompt + new
        print(tokenizer.decode(shown) if tokenizer is not None else ",".join(map(str, shown)))
    if args.verbose:
        rate = (len(new) - 1) / (end - first) if len(new) > 1 else float("nan")
        print(
            f"{len(new)} tokens; prefill + first token {1000 * (first - t0):.1f} ms; decode {rate:.1f} tokens/s",
            file=sys.stderr,
        )
        acceptance = getattr(tokens, "acceptance", None)
        if acceptance is not None:
            print(
                f"speculative: {acceptance.accepted} of {acceptance.proposed} guessed tokens accepted "
                f"({acceptance.rate:.1%}) in {acceptance.rounds} target forwards",
                file=sys.stderr,
            )
    return 0
