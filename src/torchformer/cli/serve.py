"""`torchformer serve`: an OpenAI-compatible HTTP server for a checkpoint, HF folder or preset."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ..extras import MissingExtra
from ..loading import TOKENIZER_FILE, load_any, load_tokenizer, model_kind

log = logging.getLogger("torchformer.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder (tfm.save / training), Hugging Face folder or preset name")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=8, help="requests decoded together (rows of the KV cache)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request ends (length)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TORCHFORMER_API_KEY"),
        help="require Authorization: Bearer KEY on every endpoint but /health (or $TORCHFORMER_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="the id clients pass as `model` (default: folder name)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies answer 413")
    p.add_argument("--quantize", choices=["int8", "int4"], default=None, help="weight-only quantization (tfm.quantize)")
    p.add_argument("--compile", action="store_true", help="torch.compile the batched decode step")
    p.add_argument("--seed", type=int, default=0, help="weights of a preset (random init)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def server_modules():
    try:
        import uvicorn

        from ..serve.app import create_app
        from ..serve.chat import load_chat_template
        from ..serve.engine import Engine
        from ..serve.text import Texts
    except ImportError as err:
        raise MissingExtra(f"serve needs the `serve` extra ({err.name}): pip install 'torchformer[serve]'") from err
    return uvicorn, create_app, load_chat_template, Engine, Texts


def loader(spec: str, quantize: str | None, seed: int):
    """What the engine thread calls to get the model (it loads there: /health is 503 meanwhile)."""

    def load():
        model = load_any(spec, seed=seed).eval()
        if quantize is None:
            return model
        from ..models.quantize import quantize as quantize_model

        return quantize_model(model, quantize)

    return load


def run(args: argparse.Namespace) -> int:
    """Serve MODEL over HTTP with the OpenAI API: POST /v1/completions, POST /v1/chat/completions,
    GET /v1/models, GET /health, GET /metrics. Requests are batched continuously over --slots rows
    of one static KV cache. A folder's tokenizer.json gives text in and out, its chat template
    (chat_template.jinja or tokenizer_config.json) enables chat; without a tokenizer the server
    takes and returns token ids only. Binds 127.0.0.1 unless --host says otherwise."""
    uvicorn, create_app, load_chat_template, Engine, Texts = server_modules()
    kind = model_kind(args.model)  # a bad MODEL fails here, before the server starts
    folder = Path(args.model) if kind != "preset" else None
    tokenizer = load_tokenizer(folder) if folder is not None and (folder / TOKENIZER_FILE).is_file() else None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if tokenizer is None:
        log.warning("%s has no %s: serving token ids only (prompts as lists of ids)", args.model, TOKENIZER_FILE)
    chat = load_chat_template(folder)
    if chat is None:
        log.warning("%s has no chat template: /v1/chat/completions answers 400", args.model)
    engine = Engine(
        loader(args.model, args.quantize, args.seed),
        lambda vocab_size: Texts(tokenizer, vocab_size),
        slots=args.slots,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        compile=args.compile,
    )
    name = args.served_model_name or (folder.resolve().name if folder is not None else args.model)
    app = create_app(engine, name, chat, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    engine.start()  # loads the model in its thread; /health answers 503 until it is ready
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.stop()
    return 0
