"""The serving engine: one thread, one static KV cache of ``slots`` rows, continuous batching.

Legend: R rows (slots), T prompt length, V vocabulary. Each step: drop cancelled and timed-out
requests, admit waiting ones FIFO into free rows (the prompts admitted together are prefilled in
batches over consecutive rows, rows.py's ``prefill_batches``), then one batched decode step of
(n, 1) tokens over rows 0..n-1 (n: one past the highest busy row; compiled, rounded up to a
power of two, rows.py's ``row_bucket``). Rows
without a request feed a dummy token whose key/value go to the hidden slot (DESIGN section 4),
so they change nothing. Eager steps take the key slots in use, rounded up to a multiple of SPAN
(rows.py); compiled ones every slot, one graph per row bucket, all made at start-up: on the CPU, SDPA
reads only the slots some query can see either way (nn/backends.py, ``prefix_sdpa``). The
projections' weights are packed while the engine runs (fast/panels.py: panels for the native
kernel, else oneDNN; a second copy of the weights). A freed row is reused without clearing: the
cache mask is built from positions, so the stale keys beyond the new prompt are invisible until
overwritten (each decode token writes its slot before attending).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..evaluation.embed import embed_ids
from ..fast.compiled import compile_step, cpp_host
from ..fast.scope import packed
from ..generation.steps import steady
from ..models.decoder import DecoderLM
from ..models.encoder import Encoder
from ..nn.kv_cache import KVCache
from .admission import Admission
from .calls import Calls
from .embeddings import wrong_task
from .grammar import Compilers, ResponseFormat
from .jobs import Event, Job
from .metrics import Metrics
from .model_len import for_loaded
from .prefix import Rows
from .protocol import APIError, Params, bad, new_tokens
from .rows import decode_rows, row_buckets
from .scheduler import Scheduler
from .text import Texts

log = logging.getLogger(__name__)


class Engine(Scheduler):
    def __init__(
        self,
        load: Callable[[], DecoderLM],
        texts: Callable[[int], Texts],
        *,
        slots: int = 8,
        max_queue: int = 64,
        request_timeout: float = 600.0,
        compile: bool = False,
        stall_timeout: float = 120.0,
        max_model_len: int | None = None,
        embedding: dict | None = None,
        prefix_cache: bool = True,
        threads: int | None = None,
    ) -> None:
        """``load`` gives a decoder (generation) or an encoder (embeddings; ``embedding``: pooling,
        normalize and max_length as evaluation.embed.folder_settings reads them). ``threads``: the
        engine thread's torch threads (default: the creating thread's count)."""
        limits = (("slots", slots, 1), ("max_queue", max_queue, 0), ("max_model_len", max_model_len, 1))
        for name, value, lo in (*limits, ("threads", threads, 1)):
            if value is None and name in ("max_model_len", "threads"):  # None: what fits / the creator's
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name}={value!r}: must be an integer >= {lo}")
        if not request_timeout > 0:
            raise ValueError(f"request_timeout={request_timeout!r}: must be > 0 seconds")
        self.load, self.make_texts = load, texts
        self.slots, self.max_queue, self.request_timeout, self.compile = slots, max_queue, request_timeout, compile
        self.stall_timeout = stall_timeout  # no loop turn for this long: /health says the engine is stuck
        self.beat = time.monotonic()  # the last turn of the engine loop
        self.metrics = Metrics()
        self.admission = Admission(slots, max_queue)
        self.wake = self.admission.wake  # the condition the engine sleeps on while idle
        self.rows: list[Job | None] = [None] * slots
        self.ready = False
        self.error: BaseException | None = None  # why the thread died
        self.stopping = False
        self.closing_at: float | None = None  # shutting down: running requests end at this time
        self.texts: Texts | None = None
        self.task: str | None = None  # once loaded: "generate" (a decoder) or "embed" (an encoder)
        self.embedding = {"pooling": "mean", "normalize": True, "max_length": None, **(embedding or {})}
        self.calls = Calls(self.wake, slots + max_queue)  # embedding batches, run between steps
        self.prefix_cache = prefix_cache  # place requests by the prefix their row holds (prefix.py)
        self.held = Rows(slots)
        self.compilers = Compilers()  # response_format's grammars, made on the first one (grammar.py)
        # Prompt + new tokens a request may use, the cache's length: None = what fits (model_len.py).
        self.max_model_len = max_model_len
        self.context = max_model_len or 0  # the length in use once the model has loaded
        # OpenMP's thread count is per calling thread: the engine thread uses ``threads``, by default
        # its creator's setting (the CLI gives it explicitly and keeps its own thread at one: cli/serve.py).
        self.threads = threads or torch.get_num_threads()
        self.thread = threading.Thread(target=self.run, name="torchformer-engine", daemon=True)

    # --- the app's side (any thread) ------------------------------------------------------
    def start(self) -> Engine:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def drain(self, grace: float) -> None:
        """Shutting down: waiting requests end now with a 503, running ones after ``grace`` s."""
        with self.wake:
            self.closing_at = time.monotonic() + grace
            self.wake.notify_all()

    waiting = property(lambda self: self.admission.waiting)

    @property
    def healthy(self) -> bool:
        """Loaded, alive and stepping (a turn of the loop within stall_timeout), not shutting down."""
        alive = self.ready and self.error is None and self.thread.is_alive()
        return alive and not self.stalled and self.closing_at is None

    @property
    def stalled(self) -> bool:
        return time.monotonic() - self.beat > self.stall_timeout

    def state(self) -> str:
        """Why the engine is not healthy, in a few words (for /health and 503 answers: the
        exception's text, with its paths, is for the server log only)."""
        if self.error is not None or (self.ready and not self.thread.is_alive()):
            what = "the engine stopped" if self.ready else "the model did not load"
            return what + (f" ({type(self.error).__name__}); see the server log" if self.error else "")
        if self.closing_at is not None:
            return "the server is shutting down"
        if not self.ready:
            return "the model is still loading"
        if self.stalled:
            return f"the engine has not stepped for {time.monotonic() - self.beat:.0f} s"
        return "ok"

    @property
    def running(self) -> int:
        """Requests in the batch whose end is not yet sent: a client that has its answer and reads
        /metrics at once never sees its request running (its row is freed just after)."""
        return sum(job is not None and not job.ended for job in self.rows)

    @property
    def kv_usage(self) -> float:
        """The fraction of the cache's positions (slots x max-model-len) the running requests hold."""
        held = sum(job.pos for job in list(self.rows) if job is not None)
        return held / (self.slots * self.context) if self.context else 0.0

    def grammar(self, fmt: ResponseFormat) -> tuple:
        """The compiled ``response_format`` for ``submit`` (any thread; seconds for a new schema at
        a large vocabulary, so the app calls it off its event loop), or the 400 naming the field."""
        if self.task != "generate":
            raise wrong_task("embed")
        return self.compilers.compile(fmt, self.texts.tokenizer, self.texts.vocab_size, self.eos)

    def submit(self, prompt: list[int], params: Params, sink: Callable[[Event], None], grammar=None) -> Job:
        """Queue a request (prompt ids), or raise the APIError that answers it. ``grammar``: what
        ``grammar(params.response_format)`` gave (compiled here when not given)."""
        if not self.healthy:
            raise APIError(503, f"not ready: {self.state()}", type="server_error", code="not_ready")
        if self.task != "generate":
            raise wrong_task("embed")
        if params.n > self.slots:
            raise bad(
                "n",
                f"{params.n} choices need {params.n} rows at once; this server has {self.slots} (--slots): "
                f"ask for n <= {self.slots}",
            )
        max_tokens = new_tokens(len(prompt), params, self.context)
        if params.response_format is not None and grammar is None:
            grammar = self.grammar(params.response_format)
        timeout = self.request_timeout
        group = [Job(prompt, params, max_tokens, sink, self.texts, timeout, i, grammar) for i in range(params.n)]
        for job in group:
            job.group = group
        self.admission.put(group)  # or the 429 / 503 that answers it
        return group[0]

    def cancel(self, job: Job) -> None:
        """The client went away: the rows of its request are freed at the start of the next step."""
        for one in job.group:
            one.cancelled = True
        with self.wake:
            self.wake.notify_all()

    # --- the engine thread ----------------------------------------------------------------
    def run(self) -> None:
        try:
            torch.set_num_threads(self.threads)
            with torch.inference_mode():
                self.model = self.load()
                if isinstance(self.model, Encoder):
                    self.serve_embeddings()
                    return
                if not isinstance(self.model, DecoderLM):
                    raise ValueError(f"serve needs a decoder-only or an encoder model, got {type(self.model).__name__}")
                cfg, self.task = self.model.config, "generate"
                self.device = self.model.embed.tok.weight.device  # the head may be int8
                # Before the cache: a length whose cache cannot fit fails here, not in the allocator.
                self.context = for_loaded(self.model, self.slots, self.max_model_len).value
                self.eos = frozenset([] if cfg.eos_token_id is None else [cfg.eos_token_id])
                self.texts = self.make_texts(cfg.vocab_size)
                self.cache = self.model.new_cache(batch_size=self.slots, max_len=self.context)
                self.views: dict[tuple[int, int], KVCache] = {}  # by (rows, slots)
                self.step_fn = decode_rows
                if self.compile:  # a few shapes for the engine's life: later calls skip the full guards
                    dynamo = torch._dynamo.config
                    dynamo.recompile_limit = max(dynamo.recompile_limit, len(row_buckets(self.slots)))
                    self.step_fn = steady(compile_step(decode_rows, cpp_host(self.model)), True)
                with packed(self.model, self.slots):
                    if self.compile:
                        self.compile_buckets()
                    self.beat, self.ready = time.monotonic(), True
                    log.info("engine ready: %d slots, max-model-len %d", self.slots, self.context)
                    self.loop()
        except BaseException as err:  # noqa: BLE001 - any death is reported by /health and to the requests
            self.error = err
            if self.ready:
                log.exception("the serving engine died")
            else:  # a user's error (a bad folder): one line; the traceback at debug level
                log.error("the model did not load: %s", err, exc_info=log.isEnabledFor(logging.DEBUG))
        finally:
            self.fail_all(APIError(500, f"not served: {self.state()}", type="server_error"))

    def serve_embeddings(self) -> None:
        """An encoder: no cache, no rows; the loop runs embedding batches (``embed``)."""
        cfg, self.task = self.model.config, "embed"
        self.context = min(self.embedding["max_length"] or cfg.max_seq_len, cfg.max_seq_len)
        self.texts = self.make_texts(cfg.vocab_size)
        if self.texts.tokenizer is not None:  # a folder's tokenizer.json may pad and cut (tfm.embed does this too)
            self.texts.tokenizer.no_padding()
            self.texts.tokenizer.no_truncation()
        self.beat, self.ready = time.monotonic(), True
        log.info("engine ready: embeddings, at most %d tokens an input", self.context)
        self.loop()

    def embed(self, rows: list[list[int]]) -> Future:
        """The embeddings of token-id rows, computed on the engine thread: a Future of (len(rows), D) lists."""
        settings = {k: self.embedding[k] for k in ("pooling", "normalize")}
        return self.calls.put(lambda: embed_ids(self.model, rows, **settings, batch_size=32).tolist())

    def loop(self) -> None:
        start = time.thread_time()  # CPU time is per thread: read here, on the engine thread
        while not self.stopping:
            self.beat = time.monotonic()
            self.metrics.engine_cpu = time.thread_time() - start
            self.calls.run()
            self.drop()
            self.admit()
            if self.running:
                self.step()
            else:
                with self.wake:
                    if not self.waiting and not self.calls and not self.stopping:
                        self.wake.wait(0.5)

    def fail_all(self, error: APIError) -> None:
        self.calls.fail_all(error)
        jobs = [*self.admission.clear(), *(j for j in self.rows if j is not None)]
        self.rows = [None] * self.slots
        for job in jobs:
            job.fail(error, self.metrics)
