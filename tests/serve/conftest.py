"""Fixtures for the server tests: a tiny decoder saved with a byte-level BPE tokenizer and a chat
template, an engine over it, and uvicorn on 127.0.0.1 at a free port in a background thread that
every test using it stops (finally), so no test leaves a thread, process or port behind."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import ssl
import threading
import time

import pytest
import torch

try:  # the HTTP client the installed openai uses (openai 3.x: httpx2; earlier: httpx)
    import httpx2 as _httpx
except ImportError:  # pragma: no cover
    import httpx as _httpx

import torchformer as tfm
from torchformer.serve.app import create_app
from torchformer.serve.chat import load_chat_template
from torchformer.serve.engine import Engine
from torchformer.serve.text import Texts


@functools.cache
def tls() -> ssl.SSLContext:
    """One TLS context for every client the tests make: a client built without one loads certifi's
    bundle into a context of its own, ~24 ms of CPU (each ``httpx.post`` builds a client, as does
    each ``openai.OpenAI``), and the tests build thousands (issue 33: ~30 s of the suite's CPU).
    The tests speak plain HTTP to 127.0.0.1, so the context is never used."""
    return ssl.create_default_context()


class _Httpx:
    """httpx for the tests: its request functions (get, post, stream, ...) over ``tls()``."""

    REQUESTS = frozenset({"request", "get", "post", "put", "patch", "delete", "head", "options", "stream"})

    def __getattr__(self, name: str):
        attr = getattr(_httpx, name)
        return functools.partial(attr, verify=tls()) if name in self.REQUESTS else attr


httpx = _Httpx()  # the tests import it from here

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = ["the quick brown fox jumps over the lazy dog. héllo wörld, naïve café! 0123456789 "] * 40
NAME = "tiny"


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def llama_folder(folder, max_positions: int, f16_exact: bool = False):
    """A random 2-layer HF Llama folder over ``train_tokenizer`` (nothing downloaded), its logits far
    from uniform (init 0.2) so loglikelihoods of different choices differ; ``f16_exact`` rounds
    every weight to a value an f16 GGUF file holds exactly (a GGUF copy is then the same model)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = train_tokenizer()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", pad_token="<|eos|>").save_pretrained(folder)
    torch.manual_seed(0)
    eos = tok.token_to_id("<|eos|>")
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    if f16_exact:
        for p in model.parameters():
            p.data = p.data.half().float()
    model.save_pretrained(folder)
    return folder


def tiny_config(vocab_size: int) -> tfm.ModelConfig:
    return tfm.ModelConfig(
        arch="decoder",
        vocab_size=vocab_size,
        d_model=32,
        n_layers=2,
        max_seq_len=96,
        attention=tfm.AttentionConfig(n_heads=4, n_kv_heads=2),
        block=tfm.BlockConfig(norm="rmsnorm", mlp="swiglu"),
        positions=tfm.RoPE(),
    )


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A saved tiny model with tokenizer.json and tokenizer_config.json (with a chat template)."""
    folder = tmp_path_factory.mktemp("tiny")
    tok = train_tokenizer()
    torch.manual_seed(0)
    model = tfm.build_model(tiny_config(tok.get_vocab_size())).eval()
    with torch.no_grad():  # sharper attention than init, so the prompt matters to the output
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(std=0.3)
    tfm.save(model, folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|eos|>", "bos_token": ""}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tiny(model_dir):
    return tfm.load(model_dir).eval()


def wait_until(check, timeout: float = 10.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kill_engine(engine, error: BaseException) -> None:
    """Make the engine's thread die of ``error`` at its next turn, and wait until it has."""

    def die():
        raise error

    engine.admit = die
    with engine.wake:
        engine.wake.notify_all()
    wait_until(lambda: not engine.thread.is_alive(), what="the engine to die")


def make_engine(model, tokenizer=None, **options) -> Engine:
    engine = Engine(lambda: model, lambda vocab: Texts(tokenizer, vocab), **options).start()
    wait_until(lambda: engine.healthy or engine.error is not None, timeout=60, what="the engine to load")
    return engine


class Running:
    """uvicorn serving ``app`` on 127.0.0.1 at a free port, in a thread."""

    def __init__(self, app) -> None:
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), what="uvicorn to start")
        assert self.server.started, "uvicorn did not start"
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "uvicorn did not stop"


@contextlib.contextmanager
def serving(model_dir, model, *, api_key=None, max_body_bytes=1 << 20, app=None, **engine_options):
    """(engine, base url) for a server over ``model``; always stopped on exit. ``app``: more
    keyword arguments of create_app."""
    tokenizer = tfm.load_tokenizer(model_dir)
    engine = make_engine(model, tokenizer, **engine_options)
    running = None
    try:
        options = {"api_key": api_key, "max_body_bytes": max_body_bytes, **(app or {})}
        running = Running(create_app(engine, NAME, load_chat_template(model_dir), **options))
        yield engine, running.url
    finally:
        if running is not None:
            running.stop()
        engine.stop()
        assert not engine.thread.is_alive(), "the engine thread did not stop"


def client(url: str, **kwargs):
    import openai

    options = {"api_key": "none", "max_retries": 0, "timeout": 30, **kwargs}
    return openai.OpenAI(base_url=f"{url}/v1", http_client=openai.DefaultHttpxClient(verify=tls()), **options)


@pytest.fixture(scope="module")
def server(model_dir, tiny):
    with serving(model_dir, tiny, slots=4, max_queue=16) as (engine, url):
        yield engine, url


def run_serve_cli(argv: list[str], monkeypatch, with_server) -> int:
    """`torchformer serve ARGV` in-process with uvicorn replaced: once the engine has loaded,
    ``with_server(engine, url)`` runs on this (the CLI's) thread against the app on a test server,
    which is always stopped. Returns the CLI's exit code."""
    from torchformer.cli import serve as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    create_app, load_chat_template, engine_class, texts, _ = cli.server_modules()

    def serve(app, engine, **_):
        wait_until(lambda: engine.healthy or engine.error is not None, timeout=60, what="the engine to load")
        running = Running(app)
        try:
            with_server(engine, running.url)
        finally:
            running.stop()

    monkeypatch.setattr(cli, "server_modules", lambda: (create_app, load_chat_template, engine_class, texts, serve))
    return cli.run(args)
