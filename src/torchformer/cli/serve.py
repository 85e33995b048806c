"""`torchformer serve`: an OpenAI-compatible HTTP server for a checkpoint, HF folder or preset."""

from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from ..evaluation.embed import folder_settings
from ..extras import MissingExtra
from ..loading import (
    TOKENIZER_FILE,
    has_tokenizer,
    load_any,
    load_tokenizer,
    model_config,
    model_kind,
    stored_dtype,
)
from ..models.saving import one_line
from ..serve.model_len import ModelLen, choose, free_memory
from .options import add_dtype, dtype_of

log = logging.getLogger("torchformer.serve")


def integer(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"{text!r} must be an integer >= {lo}" if hi is None else f"{text!r} must be an integer in [{lo}, {hi}]"
            )
        return value

    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of seconds > 0")
    return value


def names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder (tfm.save / training), Hugging Face folder or preset name")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port to bind (0: any free one)")
    p.add_argument("--slots", type=integer(1), default=8, help="requests decoded together (rows of the KV cache)")
    p.add_argument(
        "--max-queue",
        type=integer(0),
        default=64,
        help="requests that may wait while every row is busy; one more answers 429 (0: none wait)",
    )
    p.add_argument("--request-timeout", type=seconds, default=600.0, help="seconds before a request ends (length)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY on every endpoint but /health (default: $TORCHFORMER_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="the id clients pass as `model` (default: folder name)")
    p.add_argument("--max-body-bytes", type=integer(1), default=1 << 20, help="larger request bodies answer 413")
    p.add_argument("--body-timeout", type=seconds, default=30.0, help="seconds to send a request body (408 after)")
    p.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=5.0,
        help="on SIGTERM/SIGINT: seconds running requests may still finish before they end with 503",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names served besides this machine's own (localhost, 127.0.0.1, ::1); "
        "'*': any. Default: only those on a loopback --host, any otherwise",
    )
    p.add_argument(
        "--allowed-origins",
        default=None,
        help="comma-separated web origins (scheme://host:port) whose pages may call the server (CORS); "
        "'*': any. Default: none (requests with an Origin header answer 403)",
    )
    p.add_argument(
        "--max-model-len",
        type=integer(1),
        default=None,
        help="positions a request may use (prompt + max_tokens); sizes the KV cache (slots x this). Default: the "
        "largest whose cache fits in half the memory left after the weights, at most the model's max_seq_len",
    )
    p.add_argument("--quantize", choices=["int8", "int4"], default=None, help="weight-only quantization (tfm.quantize)")
    add_dtype(p)
    p.add_argument("--compile", action="store_true", help="torch.compile the batched decode step")
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt whole (default: a request reuses the longest prompt prefix a free row holds)",
    )
    p.add_argument(
        "--tool-call-format",
        choices=["hermes", "llama3", "mistral"],
        default=None,
        help="how the model writes tool calls: hermes (<tool_call>, Qwen2.5/3), llama3 (JSON, Llama 3.1/3.2), "
        "mistral ([TOOL_CALLS]). Default: found from the chat template's text (hermes when it says nothing)",
    )
    p.add_argument(
        "--tp",
        type=integer(1),
        default=1,
        metavar="N",
        help="tensor parallel over N processes: torchrun --nproc_per_node N -m torchformer.cli.main serve MODEL "
        "--tp N (rank 0 serves HTTP; every rank runs each step on its shard of the weights and cache)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights of a preset (random init)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def gguf_chat_template(path: str):
    """A .gguf file's tokenizer.chat_template with its BOS/EOS texts (None when it has none)."""
    from ..interop.gguf.tokenizer import chat_template_from_gguf
    from ..serve.chat import ChatTemplate

    source, bos, eos = chat_template_from_gguf(path)
    return None if not source else ChatTemplate(source, bos, eos)


def server_modules():
    try:
        from ..serve.app import create_app
        from ..serve.chat import load_chat_template
        from ..serve.engine import Engine
        from ..serve.lifecycle import serve
        from ..serve.text import Texts
    except ImportError as err:
        raise MissingExtra(f"serve needs the `serve` extra ({err.name}): pip install 'torchformer[serve]'") from err
    return create_app, load_chat_template, Engine, Texts, serve


def loader(spec: str, quantize: str | None, seed: int, dtype: torch.dtype | None = None):
    """What the engine thread calls to get the model (it loads there: /health is 503 meanwhile).
    The cast comes first, so quantized linears run with activations in ``dtype``."""

    def load():  # quantized as it is read: the float weights are never all held (tfm.load_any)
        return load_any(spec, seed=seed, dtype=dtype, quantize=quantize).eval()

    return load


def max_model_len(args: argparse.Namespace, dtype: torch.dtype | None) -> ModelLen:
    """--max-model-len checked, or the default chosen (serve/model_len.py), from the config and the
    weights' headers alone, so a length that cannot fit fails before minutes of loading. Memory
    must also hold the weights still to load and the engine's packed copy of them (estimated at
    their size in ``dtype``; quantized ones take less)."""
    from ..analysis.accounting import count_params, dtype_bytes

    try:
        cfg, dtype = model_config(args.model), dtype or stored_dtype(args.model)
    except (ValueError, OSError) as err:  # what the engine would have said, sooner
        raise ValueError(f"{args.model}: the model did not load: {one_line(err)}") from None
    if cfg.arch == "encoder":  # /v1/embeddings: no KV cache; inputs up to the model's length
        return ModelLen(cfg.max_seq_len, f"embeddings (an encoder): inputs of at most {cfg.max_seq_len} tokens")
    if cfg.arch != "decoder":
        raise ValueError(
            f"{args.model}: the model did not load: serve needs a decoder-only model (generation) or an "
            f"encoder (embeddings), not {cfg.arch!r}"
        )
    weights = count_params(cfg) * dtype_bytes(dtype)  # --tp on one host: the ranks hold all of them
    return choose(cfg, args.slots, dtype, requested=args.max_model_len, free=free_memory(2 * weights))


def allowed_hosts(host: str, given: str | None) -> list[str] | None:
    """The Host names to answer: ``--allowed-hosts`` if given, else loopback names (None) on a
    loopback bind, else any (the server was exposed on purpose)."""
    if given is not None:
        return names(given)
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return None if loopback else ["*"]


def api_key(given: str | None) -> str | None:
    """--api-key, else $TORCHFORMER_API_KEY; an empty or unsendable key is an error, not "no key"."""
    source, key = "--api-key", given
    if given is None:
        source, key = "$TORCHFORMER_API_KEY", os.environ.get("TORCHFORMER_API_KEY")
    if key is None:
        return None
    if not key:
        raise ValueError(f"{source} is empty: set a key, or unset it to serve without one")
    if not key.isascii() or any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{source}: the key has a space, a control or a non-ASCII character; use printable ASCII")
    return key


TP_TIMEOUT = 300.0  # seconds a rank waits for another in a collective before the server stops with an error


def tp_session(args: argparse.Namespace, kind: str):
    """With --tp N (> 1): the combination checked, the process group up and the TP mesh made."""
    if args.tp == 1:
        return None
    from ..parallel.session import TPSession, check_launch, check_serve

    check_launch(args.tp)  # before reading MODEL: the launch is the likelier mistake
    check_serve(args.tp, kind=kind, config=model_config(args.model), quantize=args.quantize, compile=args.compile)
    return TPSession.start(args.tp, timeout=TP_TIMEOUT)


def follow_rank(args: argparse.Namespace, split, dtype: torch.dtype | None) -> int:
    """A rank > 0 of ``serve --tp``: its shard loaded, it runs the steps rank 0 announces until
    rank 0 says stop. It ignores SIGINT and SIGTERM (torchrun and a terminal send them to every
    rank): rank 0 shuts down gracefully and then stops it."""
    from ..serve.tp import follow

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    with torch.inference_mode():
        model = split.load(args.model, dtype)
    log.info("rank %d: its shard of %s loaded; running the steps rank 0 announces", split.rank, args.model)
    follow(model, split)
    return 0


def http_thread_serial() -> int:
    """Keep this thread's torch ops on one thread; returns the count the engine thread gets.

    The engine thread runs the model; this one runs HTTP and no product worth a second thread.
    libgomp spins its idle workers between parallel regions only while the process's OpenMP
    threads fit its CPUs, and every thread that ever runs a parallel region keeps workers of its
    own for good: had this thread run one (a load, a config check), each of a decode step's ~250
    regions would wake a sleeping worker (~50 us). Measured on the 1B shape, int4 compiled, 2
    threads on 2 CPUs, one streamed request: 44-58 ms a token, against 28 ms with this thread at
    one (generate's own step: 27 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def run(args: argparse.Namespace) -> int:
    """Serve MODEL over HTTP with the OpenAI API: POST /v1/completions, POST /v1/chat/completions,
    GET /v1/models, GET /health, GET /metrics. Requests are batched continuously over --slots rows
    of one static KV cache. A folder's tokenizer.json gives text in and out, its chat template
    (chat_template.jinja or tokenizer_config.json) enables chat; without a tokenizer the server
    takes and returns token ids only. Binds 127.0.0.1 unless --host says otherwise.
    --max-model-len caps prompt + max_tokens (default: what fits in memory, said at start-up);
    --dtype bfloat16|float16|float32 casts the model (default: the checkpoint's own)."""
    create_app, load_chat_template, Engine, Texts, serve = server_modules()
    threads = http_thread_serial()
    dtype = dtype_of(args)
    key = api_key(args.api_key)
    kind = model_kind(args.model)  # a bad MODEL fails here, before the server starts
    length = max_model_len(args, dtype)  # and a context that cannot be served
    split = tp_session(args, kind)  # None without --tp
    if split is not None and split.rank != 0:
        torch.set_num_threads(threads)  # a follower runs the model in this thread
        return follow_rank(args, split, dtype)
    folder = Path(args.model) if kind != "preset" else None
    tokenizer = load_tokenizer(folder) if folder is not None and has_tokenizer(folder) else None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if tokenizer is None:
        log.warning("%s has no %s: serving token ids only (prompts as lists of ids)", args.model, TOKENIZER_FILE)
    chat = gguf_chat_template(args.model) if kind == "gguf" else load_chat_template(folder)
    if chat is None:
        log.warning("%s has no chat template: /v1/chat/completions answers 400", args.model)
    log.info("%s", length.line)
    load = loader(args.model, args.quantize, args.seed, dtype)
    if split is not None:  # rank 0 of --tp: its engine announces every step to the other ranks (serve/tp.py)
        from ..serve.tp import Leader

        Engine, load = functools.partial(Leader, split), functools.partial(split.load, args.model, dtype)  # noqa: N806
    engine = Engine(
        load,
        lambda vocab_size: Texts(tokenizer, vocab_size),
        slots=args.slots,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        compile=args.compile,
        max_model_len=length.value,
        embedding=folder_settings(folder) if folder is not None and folder.is_dir() else None,
        prefix_cache=not args.no_prefix_cache,
        threads=threads,
    )
    name = args.served_model_name or (folder.resolve().name if folder is not None else args.model)
    app = create_app(
        engine,
        name,
        chat,
        api_key=key,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
        allowed_origins=names(args.allowed_origins or ""),
        tool_call_format=args.tool_call_format,
    )
    engine.start()  # loads the model in its thread; /health answers 503 until it is ready
    try:
        serve(app, engine, host=args.host, port=args.port, log_level=args.log_level, grace=args.shutdown_timeout)
    finally:
        engine.stop()
    if engine.error is None:
        return 0
    reason = " ".join(str(engine.error).split()) or type(engine.error).__name__
    if not engine.ready:  # a bad model folder: the user's error, in one line (exit 2)
        raise ValueError(f"{args.model}: the model did not load: {reason}")
    print(f"torchformer serve: error: the serving engine stopped: {reason}", file=sys.stderr)
    return 1
