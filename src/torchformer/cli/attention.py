"""`torchformer attention`: where a model looks, as a head-statistics table, an ASCII map, a PNG
grid and a self-contained interactive HTML explorer."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .. import presets

STACKS = {"self": "decoder", "cross": "decoder", "encoder": "encoder"}  # --kind -> stack of an encoder-decoder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", help=f"a checkpoint folder, a Hugging Face folder or a preset ({', '.join(presets.names())})"
    )
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="input text (tokenized with the folder's tokenizer.json, else as UTF-8 bytes)")
    text.add_argument("--ids", help="input token ids, comma-separated (when there is no tokenizer)")
    p.add_argument("--target", help="encoder-decoder: decoder input text (default: the same as --text)")
    p.add_argument("--layer", type=int, default=None, help="only this block (default: all)")
    p.add_argument("--layers", default=None, help="only these blocks, comma-separated, e.g. 0,2 (default: all)")
    p.add_argument("--head", type=int, default=None, help="only this head (ASCII, --out, --html); default all, ASCII 0")
    p.add_argument("--heads", default=None, help="only these heads in --out and --html, comma-separated")
    p.add_argument(
        "--kind",
        choices=list(STACKS),
        default="self",
        help="self-attention (default), or for encoder-decoders cross (decoder over source) or encoder",
    )
    p.add_argument("--out", default=None, help="write a layer x head grid of heatmaps to this PNG")
    p.add_argument("--html", default=None, help="write the interactive explorer (one offline HTML file) here")
    p.add_argument("--seed", type=int, default=0, help="weights seed for a preset (random weights)")


def encode(spec: str, text: str | None, ids: str | None, vocab_size: int) -> tuple[list[int], list[str]]:
    """Token ids and their labels: from --ids, a tokenizer.json beside the model, or UTF-8 bytes."""
    if ids is not None:
        try:
            out = [int(x) for x in ids.split(",") if x.strip()]
        except ValueError as err:
            raise ValueError(f"--ids={ids!r}: must be comma-separated integers") from err
        labels = [str(i) for i in out]
    elif (Path(spec) / "tokenizer.json").is_file():
        from ..loading import load_tokenizer

        tok = load_tokenizer(spec)
        out = tok.encode(text).ids
        labels = [tok.decode([i]) or tok.id_to_token(i) or str(i) for i in out]
    else:
        data = text.encode("utf-8")
        if data and max(data) >= vocab_size:
            raise ValueError(f"--text has bytes up to {max(data)} >= vocab_size={vocab_size}; pass --ids instead")
        out, labels = list(data), [chr(b) if 32 <= b < 127 else f"\\x{b:02x}" for b in data]
    if not out:
        raise ValueError("the input is empty: give --text or --ids with at least one token")
    if max(out) >= vocab_size or min(out) < 0:
        raise ValueError(f"token ids span [{min(out)}, {max(out)}], outside [0, vocab_size={vocab_size})")
    return out, labels


def int_list(option: str, text: str | None) -> list[int] | None:
    """--layers / --heads: comma-separated integers."""
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise ValueError(f"{option}={text!r}: must be comma-separated integers such as 0,2") from err
    if not out:
        raise ValueError(f"{option}={text!r}: give at least one index")
    return out


def capture(model, ids: list[int], target: list[int] | None, layers: list[int] | None):
    from ..analysis import record_attention

    x = torch.tensor([ids])
    with torch.no_grad(), record_attention(model, layers=layers) as rec:
        if model.config.arch == "encoder_decoder":
            model(x, torch.tensor([target]))
        else:
            model(x)
    if not rec.captures:
        # Recording swaps each Attention module's backend for the math reference; a model whose
        # attention never calls its backend attribute (a fused or compiled path) records nothing.
        raise ValueError(f"{type(model).__name__}: its attention backend cannot be recorded (no weights captured)")
    return rec


def check(args: argparse.Namespace, cfg) -> None:
    """Argument errors, from the config alone, before any weights are loaded or files written."""
    if args.kind != "self" and cfg.arch != "encoder_decoder":
        raise ValueError(f"--kind {args.kind} needs an encoder-decoder; this model is a {cfg.arch}")
    n = cfg.n_layers if args.kind == "encoder" else cfg.decoder_layers
    if args.layer is not None and not 0 <= args.layer < n:
        raise ValueError(f"--layer={args.layer}: must be in [0, {n})")
    bad = [i for i in int_list("--layers", args.layers) or [] if not 0 <= i < n]
    if bad:
        raise ValueError(f"--layers={args.layers}: {bad} outside the model's blocks [0, {n})")
    H = cfg.attention.n_heads
    if args.head is not None and not 0 <= args.head < H:
        raise ValueError(f"--head={args.head}: must be in [0, {H})")
    bad = [h for h in int_list("--heads", args.heads) or [] if not 0 <= h < H]
    if bad:
        raise ValueError(f"--heads={args.heads}: {bad} outside the model's heads [0, {H})")
    for option in ("out", "html"):
        path = getattr(args, option)
        if path is not None and Path(path).is_dir():
            raise ValueError(f"--{option}={path}: is a directory; give a file name")


def print_stats(captures) -> None:
    from ..analysis import head_stats

    print(f"{'layer':<26} {'head':>4} {'entropy':>8} {'max':>6} {'distance':>9}")
    for c in captures:
        for h, ent, top, dist in head_stats(c.weights).rows():
            print(f"{c.name:<26} {h:>4} {ent:>8.3f} {top:>6.3f} {dist:>9.2f}")


def run(args: argparse.Namespace) -> int:
    """Record the attention of MODEL on a text; print per-head statistics and an ASCII map.

    MODEL is a checkpoint, a Hugging Face folder or a preset (random weights). Entropy is in
    nats (ln of the number of keys for a uniform head), max is the mean largest weight, distance
    is the mean sum_j a_ij |i - j| in tokens. Encoder-decoders: --text is the source, --target
    the decoder input; --kind self (decoder), cross (decoder over the source) or encoder picks
    what the table, ASCII map and PNG show; the HTML explorer shows every kind.

    torchformer attention runs/shakespeare-char --text "ROMEO: But soft" --out attn.png --html attn.html
    """
    from ..analysis import ascii_attention, attention_figure, to_html
    from ..analysis.plots import save_png
    from ..loading import load_any
    from .plan import config_of

    cfg = config_of(args.model)
    check(args, cfg)
    ids, labels = encode(args.model, args.text, args.ids, cfg.vocab_size)
    target, t_labels = ids, labels
    if args.target is not None:
        target, t_labels = encode(args.model, args.target, None, cfg.vocab_size)
    if max(len(ids), len(target)) > cfg.max_seq_len:
        raise ValueError(f"the input has {max(len(ids), len(target))} tokens > max_seq_len={cfg.max_seq_len}")
    layers = [args.layer] if args.layer is not None else int_list("--layers", args.layers)
    heads = [args.head] if args.head is not None else int_list("--heads", args.heads)
    rec = capture(load_any(args.model, seed=args.seed), ids, target, layers)
    two_sided = cfg.arch == "encoder_decoder"
    caps = rec.select(kind="cross" if args.kind == "cross" else "self", stack=STACKS[args.kind] if two_sided else None)
    q_labels = t_labels if two_sided and args.kind != "encoder" else labels
    k_labels = labels if args.kind != "self" else q_labels
    # Everything is drawn before anything is written: an error leaves no partial output.
    figure = page = None
    if args.out is not None:
        figure = attention_figure(
            [c.weights for c in caps], tokens=q_labels, key_tokens=k_labels, titles=[c.name for c in caps], heads=heads
        )
    if args.html is not None:
        title = f"attention of {Path(args.model).name or args.model}"
        page = to_html(rec, labels, target_tokens=t_labels if two_sided else None, heads=heads, title=title)
    print_stats(caps)
    head = heads[0] if heads else 0
    print(f"\n{caps[0].name} head {head} (rows: queries, columns: keys; denser = more weight)")
    print(ascii_attention(caps[0].weights[0, head], q_labels, k_labels))
    if figure is not None:
        print(f"\nwrote {save_png(figure, args.out)}")
    if page is not None:
        print(f"wrote {page.save(args.html)} (open it in a browser; it needs no network)")
    return 0
