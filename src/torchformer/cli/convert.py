"""`torchformer convert`: Hugging Face folder <-> torchformer checkpoint; GGUF file <-> model."""

from __future__ import annotations

import argparse
from pathlib import Path

TOKENIZER = "tokenizer.json"
# to_gguf's dtypes (interop/gguf/write.py DTYPES; a test keeps them equal): the K-quants are made
# by llama.cpp's quantizer and need llama-cpp-python.
GGUF_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q3_k_m", "q2_k")


def add_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="a local Hugging Face model folder to read")
    source.add_argument("--to-hf", metavar="CKPT", help="a torchformer checkpoint folder (or preset name) to export")
    source.add_argument("--from-gguf", metavar="FILE", help="a .gguf file to write as a Hugging Face folder")
    source.add_argument("--from-dcp", metavar="CKPT", help="a sharded (DCP) training checkpoint to write as one file")
    source.add_argument(
        "--to-gguf", metavar="MODEL", help="a checkpoint or HF folder (with tokenizer.json) to write as .gguf"
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder to write: new, empty, or a model folder of the same kind (replaced atomically); "
        "never the source folder, one inside it or one holding it",
    )
    p.add_argument(
        "--outtype",
        choices=GGUF_TYPES,
        default="f16",
        help="with --to-gguf: matrix type (f16; K-quants such as q4_k_m need llama-cpp-python)",
    )
    p.add_argument("--force", action="store_true", help="replace --out even if it holds other files (they are lost)")
    p.add_argument(
        "--rope-pairing",
        choices=["half", "interleaved"],
        default="half",
        help="with --from-hf: RoPE layout of the converted model (permutes q/k rows; same logits)",
    )
    p.add_argument("--no-strict", action="store_true", help="with --from-hf: drop tensors no rule knows")
    p.add_argument(
        "--model-type", help="with --to-hf: force a family (llama, mistral, qwen2, gpt2, bert, bart, marian)"
    )
    p.add_argument("--quantize", choices=["int8", "int4"], default=None, help="with --from-hf: save it quantized")
    p.add_argument("--group-size", type=int, default=None, help="with --quantize int4: inputs per scale (default 64)")


def run(args: argparse.Namespace) -> int:
    """Convert checkpoints, keeping every weight bit-exact.

    torchformer convert --from-hf HF_DIR --out CKPT    HF folder -> torchformer checkpoint
    torchformer convert --to-hf CKPT --out HF_DIR      torchformer checkpoint -> HF folder
    torchformer convert --from-hf HF_DIR --out CKPT --quantize int8   ... saved weight-only int8
    torchformer convert --from-gguf FILE.gguf --out HF_DIR  GGUF -> HF folder (float32, quantized
                                                       types dequantized; tokenizer.json from its metadata)
    torchformer convert --to-gguf CKPT --out FILE.gguf --outtype q8_0   model + tokenizer.json -> GGUF
    torchformer convert --from-dcp STEP_DIR --out CKPT  sharded (DCP) training checkpoint -> one-file folder

    tokenizer.json is copied along when the source folder has one. Nothing is downloaded. An
    existing --out is replaced only when it is empty or a model folder of the kind written (its
    files are the ones the conversion writes); --force replaces any folder. Nothing is written
    when the conversion fails.
    """
    from .. import load, load_any, quantize, save
    from ..interop import from_hf, to_hf

    if args.quantize is not None and args.from_hf is None:
        raise ValueError(f"--quantize {args.quantize} works with --from-hf (HF folders hold float weights)")
    if args.group_size is not None and args.quantize is None:
        raise ValueError(f"--group-size={args.group_size} needs --quantize int4")
    check_out(args.from_hf or args.to_hf or args.from_gguf or args.to_gguf or args.from_dcp, args.out)
    if args.to_gguf is not None:
        from ..interop.gguf import to_gguf
        from ..loading import has_tokenizer, load_tokenizer

        if not has_tokenizer(args.to_gguf):
            raise ValueError(
                f"--to-gguf {args.to_gguf!r}: no {TOKENIZER} beside the model; llama.cpp needs a vocabulary"
            )
        from ..interop.gguf.quantize import K_QUANTS, check_k_quant
        from ..text.chat_template import load_chat_template

        if args.outtype in K_QUANTS:
            check_k_quant(args.outtype)  # llama-cpp-python is there, before the model is read
        chat = load_chat_template(args.to_gguf)  # as serve finds it; written for llama.cpp's server and Ollama
        model, tokenizer = load_any(args.to_gguf), load_tokenizer(args.to_gguf)
        out = to_gguf(model, args.out, dtype=args.outtype, tokenizer=tokenizer, chat_template=chat and chat.source)
        kind = f"GGUF file ({args.outtype})"
    elif args.from_gguf is not None:
        from ..interop.gguf import from_gguf
        from ..interop.gguf.tokenizer import tokenizer_from_gguf

        model = from_gguf(args.from_gguf, quantized=False)  # an HF folder holds float weights
        text = tokenizer_from_gguf(args.from_gguf).to_str()
        out = to_hf(model, args.out, model_type=args.model_type, tokenizer=text, force=args.force)
        kind = "Hugging Face folder"
    elif args.from_dcp is not None:
        from ..models.sharded import is_sharded

        if not is_sharded(args.from_dcp):
            raise ValueError(f"--from-dcp {args.from_dcp!r}: not a sharded checkpoint (no dcp/ folder inside)")
        model = load(args.from_dcp)  # every rank's shards stitched into whole tensors
        out = save(model, args.out, extra_files=_tokenizer(args.from_dcp), force=args.force)
        kind = f"torchformer checkpoint ({model.config.arch}, {sum(p.numel() for p in model.parameters()):,} params)"
    elif args.from_hf is not None:
        model = from_hf(args.from_hf, rope_pairing=args.rope_pairing, strict=not args.no_strict)
        n_params = sum(p.numel() for p in model.parameters())
        if args.quantize is not None:
            model = quantize(model, args.quantize, group_size=args.group_size)
        out = save(model, args.out, extra_files=_tokenizer(args.from_hf), force=args.force)
        kind = f"torchformer checkpoint ({model.config.arch}, {n_params:,} params"
        kind += f", {args.quantize} weights)" if args.quantize else ")"
    else:
        model = load_any(args.to_hf)
        text = _tokenizer(args.to_hf).get(TOKENIZER)
        out = to_hf(model, args.out, model_type=args.model_type, tokenizer=text, force=args.force)
        kind = "Hugging Face folder"
    print(f"wrote {kind} to {out}")
    return 0


def check_out(source: str, out: str) -> None:
    """--out may not be the source folder, inside it or around it: replacing it would delete the
    source (even with --force). A preset name as --to-hf has no folder."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if not Path(source).is_dir():
        return
    if dst == src or dst.is_relative_to(src):
        raise ValueError(f"--out {out!r} is the source folder {source!r} or inside it: write to another folder")
    if src.is_relative_to(dst):
        raise ValueError(f"--out {out!r} holds the source folder {source!r}: replacing it would delete the source")


def _tokenizer(folder: str) -> dict[str, str]:
    file = Path(folder) / TOKENIZER
    return {TOKENIZER: file.read_text()} if file.is_file() else {}
