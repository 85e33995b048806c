"""The engine thread's work on the rows of the cache, each turn of its loop (engine.py says how):
``drop`` (cancelled, timed out, shutting down), ``admit`` + ``prefill`` (waiting requests into
free rows, a request's n choices into n rows), ``step`` (one batched decode step, per-row
sampling and logprobs). A mixin of Engine, which owns the state it reads (rows, cache, model).
"""

from __future__ import annotations

import logging
import time

import torch

from ..generation.topk import argmax
from .grammar import masked_argmax
from .groups import first_tokens
from .jobs import Job, Prompt
from .logprobs import step_logprobs
from .protocol import APIError, shutting_down
from .rows import copy_row, prefill_batches, prefill_rows, row_bucket, row_buckets, rows_view, span

log = logging.getLogger(__name__)


class Scheduler:
    # The engine's three uses of its model and cache besides the decode step (``step_fn``), as
    # methods: a tensor-parallel server's rank 0 announces each to the other ranks first (tp.py).
    def prefill_rows(self, start: int, prompts: list[list[int]], reused: int):
        return prefill_rows(self.model, self.cache, start, prompts, reused)  # (b, V), (b, T, D)

    def copy_row(self, src: int, dst: int, length: int) -> None:
        copy_row(self.cache, src, dst, length)

    def head(self, hidden):
        return self.model.lm_head(hidden)  # (..., D) -> (..., V)

    def view(self, rows: int, length: int):
        """Rows 0..rows-1 and key slots 0..length-1 of the cache, made once per shape (rows.py)."""
        if (rows, length) not in self.views:
            self.views[rows, length] = rows_view(self.cache, 0, rows, length)
        return self.views[rows, length]

    def compile_buckets(self) -> None:
        """--compile: the decode step's graph for every row bucket, made before the first request
        (as vLLM captures its graphs at start-up), so no request waits for a compile when the
        concurrency first reaches a new bucket. All rows are idle: their dummy keys go to the hidden
        slot, so no row's cache changes."""
        buckets = row_buckets(self.slots)
        log.info("compiling the decode step for %s rows, once, before the first request", buckets)
        length = self.cache.max_len
        for n in buckets:
            # Three tensors, as a step passes them (one tensor in two places would be guarded on).
            ids, pos = (torch.zeros(n, 1, dtype=torch.long, device=self.device) for _ in range(2))  # (n, 1)
            live = torch.zeros(n, 1, dtype=torch.bool, device=self.device)  # (n, 1)
            self.step_fn(self.model, ids, pos, live, self.view(n, length))

    def free(self, job: Job) -> None:
        """The row is free; its cache keeps the tokens written (the last chosen one is not)."""
        self.rows[job.row] = None
        self.held.hold(job.row, (job.prompt + job.tokens)[: job.pos - 1])
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
        hits = []  # (row, group, reused tokens): prefilled alone, after the reused prefix
        for group in list(ready) if self.prefix_cache else ():
            if not (group[0].params.echo and group[0].params.logprobs is not None):  # echo scores the whole prompt
                row, hit = self.held.best(free, group[0].prompt)
                if row is not None:
                    hits.append((row, group, hit))
                    free.remove(row)
                    ready.remove(group)
        rest = iter(free[len(ready) :])
        placed = [(row, g, [next(rest) for _ in g[1:]]) for row, g in zip(free, ready)]
        for batch in prefill_batches([(row, g[0].prompt) for row, g, _ in placed]):
            self.prefill([placed[i] for i in batch])
        for row, group, hit in hits:
            self.prefill([(row, group, [next(rest) for _ in group[1:]])], hit)

    def prefill(self, batch: list[tuple[int, list[Job], list[int]]], reused: int = 0) -> None:
        """One batched prefill of the groups' first jobs into consecutive rows (``reused``: one row
        whose first tokens are cached, so only the rest is prefilled)."""
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
            prompts = [g[0].prompt[reused:] if g[0] in started else [0] for _, g, _ in batch]
            self.held.written([row for row, _, _ in batch], reused)
            logits, hidden = self.prefill_rows(batch[0][0], prompts, reused)  # (b, V), (b, T, D)
        except Exception as err:  # noqa: BLE001 - these requests fail; the engine goes on
            for _, group, _ in batch:
                if group[0] in started:
                    self.fail_group(group, err)
            return
        for i, (_, group, rows) in enumerate(batch):
            if group[0] not in started:
                continue
            try:
                group[0].cached = reused
                self.metrics.prefix(len(group[0].prompt), reused)
                firsts = first_tokens(self, group, rows, logits[i : i + 1], hidden[i], self.texts.vocab_size)
            except Exception as err:  # noqa: BLE001 - this request fails; the others go on
                self.fail_group(group, err)
                for row in rows:  # a copy into them may have begun
                    self.held.forget(row)
                continue
            self.place(group, *firsts)

    def place(self, group: list[Job], echo: tuple, tokens: list[int], scored: list) -> None:
        for job in group:
            if job.params.echo:
                job.sink(Prompt(echo, job.index))
            if not tokens:  # max_tokens 0: the prompt scored, nothing generated
                self.held.hold(job.row, job.prompt)
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
        """Fail one request with a 500 saying what failed (called inside its except block), or
        with the APIError raised about the request itself."""
        if isinstance(err, APIError):
            job.fail(err, self.metrics)
            return
        log.exception("%s: request %s", what, job.id)
        job.fail(APIError(500, f"{what}: {err!r}", type="server_error"), self.metrics)

    def step(self) -> None:
        """One batched decode step for all rows; per-row sampling; one host read of the tokens."""
        jobs = [j for j in self.rows if j is not None]
        # Only rows 0..n-1 (admission takes the lowest free row): a lone request costs a one-row
        # step, not an R-row one. Eager: the key slots in use too, so a short request reads a short
        # cache. Compiled: n rounded up to a power of two over all slots, a few graphs for the
        # engine's life (module docstring).
        n = 1 + max(j.row for j in jobs)
        if self.compile:
            n, length = row_bucket(n, self.slots), self.cache.max_len
        else:
            length = span(max(j.pos for j in jobs), self.cache.max_len)
        view = self.view(n, length)
        rows = self.rows[:n]
        ids = torch.tensor([[0 if j is None else j.tokens[-1]] for j in rows], device=self.device)  # (n, 1)
        pos = torch.tensor([[0 if j is None else j.pos - 1] for j in rows], device=self.device)  # (n, 1)
        live = torch.tensor([[j is not None] for j in rows], device=self.device)  # (n, 1)
        try:
            logits = self.step_fn(self.model, ids, pos, live, view)  # (n, V)
        except Exception as err:  # noqa: BLE001 - every running request fails; the engine goes on
            for job in jobs:
                self.fail(job, "the decode step failed", err)
                self.free(job)
                self.held.forget(job.row)  # what the step wrote is unknown
            return
        if length < self.cache.max_len:  # the idle rows' dummy keys went to slot ``length`` (prefix.py)
            self.held.written([r for r, j in enumerate(rows) if j is None], length)
        tokens = argmax(logits)  # (n,): the choice of every greedy row (generation/topk.py: torch's argmax, faster)
        failed = set()
        masked = [j for j in jobs if j.masked_greedy]
        if masked:  # greedy under a grammar: all such rows in one masked argmax
            try:
                rows = [j.row for j in masked]
                tokens[rows] = masked_argmax(logits, [j.constraint for j in masked], rows)
            except Exception as err:  # noqa: BLE001 - these requests fail; the others go on
                for job in masked:
                    self.fail(job, "sampling failed", err)
                    self.free(job)
                    failed.add(job.id)
        for job in jobs:
            if job.fast or job.masked_greedy:
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
