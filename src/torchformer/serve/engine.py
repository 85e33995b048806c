"""The serving engine: one thread, one static KV cache of ``slots`` rows, continuous batching.

Legend: R rows (slots), T prompt length, V vocabulary. Each step: drop cancelled and timed-out
requests, admit waiting ones FIFO into free rows (the prompts admitted together are prefilled in
batches over consecutive rows, rows.py's ``prefill_batches``), then one batched decode step of
(n, 1) tokens over rows 0..n-1 (n: one past the highest busy row; all R when compiled). Rows
without a request feed a dummy token whose key/value go to the hidden slot (DESIGN section 4),
so they change nothing. Eager steps take the key slots in use, rounded up to a multiple of SPAN
(rows.py); compiled ones the whole cache, one graph for the engine's life: on the CPU, SDPA
reads only the slots some query can see either way (nn/backends.py, ``prefix_sdpa``). The
projections' weights are packed while the engine runs (nn/packed.py: panels for the native
kernel, else oneDNN; a second copy of the weights). A freed row is reused without clearing: the
cache mask is built from positions, so the stale keys beyond the new prompt are invisible until
overwritten (each decode token writes its slot before attending).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from ..fast.scope import packed
from ..generation.steps import steady
from ..models.decoder import DecoderLM
from ..nn.kv_cache import KVCache
from .admission import Admission
from .groups import first_tokens
from .jobs import Event, Job, Prompt
from .logprobs import step_logprobs
from .metrics import Metrics
from .model_len import for_loaded
from .protocol import APIError, Params, bad, new_tokens, shutting_down
from .rows import decode_rows, prefill_batches, prefill_rows, rows_view, span
from .text import Texts

log = logging.getLogger(__name__)


class Engine:
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
    ) -> None:
        for name, value, lo in (("slots", slots, 1), ("max_queue", max_queue, 0), ("max_model_len", max_model_len, 1)):
            if value is None and name == "max_model_len":  # None: what fits
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
        # Prompt + new tokens a request may use, the cache's length: None = what fits (model_len.py).
        self.max_model_len = max_model_len
        self.context = max_model_len or 0  # the length in use once the model has loaded
        # OpenMP's thread count is per calling thread: the engine thread uses its creator's setting.
        self.threads = torch.get_num_threads()
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
        return sum(job is not None for job in self.rows)

    @property
    def kv_usage(self) -> float:
        """The fraction of the cache's positions (slots x max-model-len) the running requests hold."""
        held = sum(job.pos for job in list(self.rows) if job is not None)
        return held / (self.slots * self.context) if self.context else 0.0

    def submit(self, prompt: list[int], params: Params, sink: Callable[[Event], None]) -> Job:
        """Queue a request (prompt ids), or raise the APIError that answers it."""
        if not self.healthy:
            raise APIError(503, f"not ready: {self.state()}", type="server_error", code="not_ready")
        if params.n > self.slots:
            raise bad(
                "n",
                f"{params.n} choices need {params.n} rows at once; this server has {self.slots} (--slots): "
                f"ask for n <= {self.slots}",
            )
        max_tokens = new_tokens(len(prompt), params, self.context)
        group = [Job(prompt, params, max_tokens, sink, self.texts, self.request_timeout, i) for i in range(params.n)]
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
                if not isinstance(self.model, DecoderLM):
                    raise ValueError(f"serve needs a decoder-only model, got {type(self.model).__name__}")
                cfg = self.model.config
                self.device = self.model.embed.tok.weight.device  # the head may be int8
                # Before the cache: a length whose cache cannot fit fails here, not in the allocator.
                self.context = for_loaded(self.model, self.slots, self.max_model_len).value
                self.eos = frozenset([] if cfg.eos_token_id is None else [cfg.eos_token_id])
                self.texts = self.make_texts(cfg.vocab_size)
                self.cache = self.model.new_cache(batch_size=self.slots, max_len=self.context)
                self.views: dict[tuple[int, int], KVCache] = {}  # by (rows, slots)
                self.step_fn = decode_rows
                if self.compile:  # one shape for the engine's life: later calls skip the full guards
                    self.step_fn = steady(torch.compile(decode_rows, dynamic=False, fullgraph=True), True)
                with packed(self.model, self.slots):
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

    def loop(self) -> None:
        while not self.stopping:
            self.beat = time.monotonic()
            self.drop()
            self.admit()
            if self.running:
                self.step()
            else:
                with self.wake:
                    if not self.waiting and not self.stopping:
                        self.wake.wait(0.5)

    def fail_all(self, error: APIError) -> None:
        jobs = [*self.admission.clear(), *(j for j in self.rows if j is not None)]
        self.rows = [None] * self.slots
        for job in jobs:
            job.fail(error, self.metrics)

    def free(self, job: Job) -> None:
        self.rows[job.row] = None
        self.admission.give_back()

    def drop(self) -> None:
        """Cancelled rows are freed silently; rows past their deadline end with "length". Shutting
        down (drain), waiting requests end at once, running ones at closing_at, with a 503."""
        now, closing = time.monotonic(), self.closing_at is not None
        for job in self.admission.close() if closing else ():
            job.fail(shutting_down(), self.metrics)
        for job in [j for j in self.rows if j is not None]:
            if job.cancelled:
                self.metrics.finish("cancelled")
                self.free(job)
            elif closing and now >= self.closing_at:
                job.fail(shutting_down(), self.metrics)
                self.free(job)
            elif now > job.deadline:
                job.finish("length", self.metrics)
                self.free(job)

    def admit(self) -> None:
        """Waiting requests FIFO into the free rows, prefilled in batches (``prefill_batches``);
        the shortest prompts take the lowest rows, so a batch pads little. A request for n choices
        prefills its first job's row; its other jobs take rows after the batch's (``place``)."""
        now, free = time.monotonic(), [r for r, j in enumerate(self.rows) if j is None]
        ready = []
        for group in self.admission.take(len(free)):
            for job in group if group[0].cancelled or now > group[0].deadline else ():
                if job.cancelled:
                    self.metrics.finish("cancelled")
                else:
                    job.finish("length", self.metrics)  # timed out in the queue: no tokens
                self.admission.give_back()
            if not group[0].cancelled and now <= group[0].deadline:
                ready.append(group)
        ready.sort(key=lambda g: len(g[0].prompt))
        rest = iter(free[len(ready) :])
        placed = [(row, g, [next(rest) for _ in g[1:]]) for row, g in zip(free, ready)]
        for batch in prefill_batches([(row, g[0].prompt) for row, g, _ in placed]):
            self.prefill([placed[i] for i in batch])

    def prefill(self, batch: list[tuple[int, list[Job], list[int]]]) -> None:
        """One batched prefill of the groups' first jobs into consecutive rows."""
        started = []
        for row, group, _ in batch:
            try:
                group[0].start(row, self.texts.vocab_size, self.device)
                started.append(group[0])
            except Exception as err:  # noqa: BLE001 - this request fails; the others go on
                self.fail_group(group, err)
        if not started:
            return
        try:
            # A failed start leaves a hole: the others still need consecutive rows, so the batch
            # keeps its rows and the hole's prompt is a dummy one whose row stays free.
            prompts = [g[0].prompt if g[0] in started else [0] for _, g, _ in batch]
            logits, hidden = prefill_rows(self.model, self.cache, batch[0][0], prompts)  # (b, V), (b, T, D)
        except Exception as err:  # noqa: BLE001 - these requests fail; the engine goes on
            for _, group, _ in batch:
                if group[0] in started:
                    self.fail_group(group, err)
            return
        for i, (_, group, rows) in enumerate(batch):
            if group[0] not in started:
                continue
            try:
                self.metrics.prefix(len(group[0].prompt), 0)  # no prefix reuse yet: every token prefilled
                firsts = first_tokens(
                    self.model, self.cache, group, rows, logits[i : i + 1], hidden[i], self.texts.vocab_size
                )
            except Exception as err:  # noqa: BLE001 - this request fails; the others go on
                self.fail_group(group, err)
                continue
            self.place(group, *firsts)

    def place(self, group: list[Job], echo: tuple, tokens: list[int], scored: list) -> None:
        for job in group:
            if job.params.echo:
                job.sink(Prompt(echo, job.index))
            if not tokens:  # max_tokens 0: the prompt scored, nothing generated
                job.finish("length", self.metrics)
                self.admission.give_back()
                continue
            self.rows[job.row] = job
            if job.accept(tokens[job.index], self.eos, self.metrics, scored[job.index]):
                self.free(job)

    def fail_group(self, group: list[Job], err: Exception) -> None:
        """Fail a request that holds no row yet (inside its except block); its rows are given back."""
        for job in group:
            self.fail(job, "the request failed inside the engine", err)
            self.admission.give_back()

    def fail(self, job: Job, what: str, err: Exception) -> None:
        """Fail one request with a 500 saying what failed (called inside its except block)."""
        log.exception("%s: request %s", what, job.id)
        job.fail(APIError(500, f"{what}: {err!r}", type="server_error"), self.metrics)

    def step(self) -> None:
        """One batched decode step for all rows; per-row sampling; one host read of the tokens."""
        jobs = [j for j in self.rows if j is not None]
        # Eager: only rows 0..n-1 (admission takes the lowest free row) and the key slots in use: a
        # lone short request costs a one-row step over a short cache, not an R-row one over max_len.
        # Compiled: every step all R rows and all slots, one graph (module docstring).
        n, length = self.slots, self.cache.max_len
        if not self.compile:
            n, length = 1 + max(j.row for j in jobs), span(max(j.pos for j in jobs), self.cache.max_len)
        if (n, length) not in self.views:
            self.views[n, length] = rows_view(self.cache, 0, n, length)
        rows = self.rows[:n]
        ids = torch.tensor([[0 if j is None else j.tokens[-1]] for j in rows], device=self.device)  # (n, 1)
        pos = torch.tensor([[0 if j is None else j.pos - 1] for j in rows], device=self.device)  # (n, 1)
        live = torch.tensor([[j is not None] for j in rows], device=self.device)  # (n, 1)
        try:
            logits = self.step_fn(self.model, ids, pos, live, self.views[n, length])  # (n, V)
        except Exception as err:  # noqa: BLE001 - every running request fails; the engine goes on
            for job in jobs:
                self.fail(job, "the decode step failed", err)
                self.free(job)
            return
        tokens = logits.argmax(-1)  # (n,): the choice of every greedy row
        failed = set()
        for job in jobs:
            if job.fast:
                continue
            try:
                tokens[job.row] = job.sample(logits[job.row : job.row + 1])[0]
            except Exception as err:  # noqa: BLE001 - this request fails; the others go on
                self.fail(job, "sampling failed", err)
                self.free(job)
                failed.add(job.id)
        values = tokens.tolist()
        asked = [j for j in jobs if j.params.logprobs is not None and j.id not in failed]
        scored = self.logprobs(logits, asked, values)
        for job in jobs:
            if job.id in failed or job.id in scored and scored[job.id] is None:
                continue
            if job.accept(values[job.row], self.eos, self.metrics, scored.get(job.id)):
                self.free(job)

    def logprobs(self, logits, jobs: list[Job], values: list[int]) -> dict:
        """The chosen tokens' logprobs (and top alternatives) of the rows that asked, one host read;
        a failure fails those requests (their entry is None)."""
        if not jobs:
            return {}
        try:
            rows = [j.row for j in jobs]
            entries = step_logprobs(logits, rows, [values[r] for r in rows], [j.params.logprobs for j in jobs])
        except Exception as err:  # noqa: BLE001 - these requests fail; the others go on
            for job in jobs:
                self.fail(job, "logprobs failed", err)
                self.free(job)
            return dict.fromkeys((j.id for j in jobs), None)
        return {j.id: e for j, e in zip(jobs, entries)}
