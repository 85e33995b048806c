"""The engine against tfm.generate: a request served among others (staggered arrivals, rows
reused without clearing, a cancellation in between) gives exactly the tokens generate gives
for the same prompt, settings and seed, over the decoder rows of the variant grid."""

from __future__ import annotations

import threading

import pytest
import torch

import torchformer as tfm
from tests.grid import build, params, variants
from tests.serve.conftest import make_engine, wait_until
from torchformer.generation.request import sampling_options
from torchformer.serve.jobs import Delta, Done, Failed
from torchformer.serve.protocol import APIError, Params

GRID = variants(("decoder",))


def options(max_tokens, temperature=0.0, seed=None, stop=(), n=1, logprobs=None, echo=False, **sampling) -> Params:
    s = sampling_options(
        temperature,
        sampling.get("top_k"),
        sampling.get("top_p"),
        sampling.get("min_p"),
        sampling.get("repetition_penalty", 1.0),
        0,
    )
    return Params(max_tokens, s, seed, tuple(stop), False, False, False, n, logprobs, echo)


class Collect:
    """A sink: the events of one request, and an Event set when it has ended."""

    def __init__(self) -> None:
        self.events, self.ended = [], threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, Done | Failed):
            self.ended.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, Delta) for t in e.token_ids]

    @property
    def end(self):
        return self.events[-1]


# (prompt length, max_tokens, sampling): greedy, seeded sampling with each processor.
REQUESTS = [
    (5, 14, {}),
    (9, 10, {"temperature": 0.9, "seed": 1, "top_k": 7}),
    (3, 30, {"repetition_penalty": 1.3}),  # cancelled at step 4
    (12, 16, {"temperature": 0.8, "seed": 7, "top_p": 0.9}),
    (20, 12, {"temperature": 1.1, "seed": 3, "min_p": 0.05, "repetition_penalty": 1.2}),
    (7, 9, {}),
]
# step -> requests submitted before that decode step (0 = before the first); slots = 3.
ARRIVALS = {0: [0, 1], 2: [2, 3], 6: [4], 9: [5]}
CANCEL_AT = {4: 2}


def generate_alone(model, prompt, n, sampling) -> list[int]:
    out = tfm.generate(model, torch.tensor([prompt]), max_new_tokens=n, **sampling)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("v", **params(GRID))
def test_served_equals_generate_with_staggered_arrivals_reuse_and_cancellation(v):
    model = build(v, seed=3)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.config.vocab_size, (t,), generator=g).tolist() for t, _, _ in REQUESTS]
    engine = make_engine(model, slots=3)
    sinks = [Collect() for _ in REQUESTS]
    jobs, live_rows, admitted = {}, [], []
    try:
        step, inner = [0], engine.step_fn

        def submit(i):
            n, sampling = REQUESTS[i][1], REQUESTS[i][2]
            jobs[i] = engine.submit(prompts[i], options(n, **sampling), sinks[i])

        def hooked(m, ids, pos, live, cache):  # runs on the engine thread, before each decode step
            for i in ARRIVALS.get(step[0], []) if step[0] else []:  # step 0's are submitted below
                submit(i)
            if step[0] in CANCEL_AT:
                engine.cancel(jobs[CANCEL_AT[step[0]]])
            live_rows.append(int(live.sum()))
            admitted.append({i: j.row for i, j in jobs.items()})
            step[0] += 1
            return inner(m, ids, pos, live, cache)

        engine.step_fn = hooked
        with engine.wake:  # the engine admits none of these before all are queued
            for i in ARRIVALS[0]:
                submit(i)
        for i, sink in enumerate(sinks):
            if i != CANCEL_AT[4]:
                assert sink.ended.wait(30), f"request {i} did not finish"
        wait_until(lambda: engine.running == 0, what="all rows free")
    finally:
        engine.stop()
    assert engine.error is None
    assert max(live_rows) == 3 and min(live_rows) >= 1, "requests must have shared decode steps"
    rows = [admitted[-1][i] for i in range(len(REQUESTS))]
    assert len(set(rows)) < len(REQUESTS), "some row must have been reused"
    cancelled = sinks[CANCEL_AT[4]]
    assert 0 < len(cancelled.tokens) < REQUESTS[2][1], "the cancelled request was running when cancelled"
    assert not any(isinstance(e, Done | Failed) for e in cancelled.events)
    assert rows[3] == rows[2], "the waiting request takes the cancelled request's row"
    for i, (_, n, sampling) in enumerate(REQUESTS):
        if i == CANCEL_AT[4]:
            continue
        assert sinks[i].tokens == generate_alone(model, prompts[i], n, sampling), f"request {i} ({sampling})"
        assert sinks[i].end == Done("length", len(prompts[i]), n)


# Arriving together: one batched prefill (lengths 2..19, right-padded), then shared decode steps.
TOGETHER = [
    (19, 6, {"temperature": 0.9, "seed": 5, "top_k": 9}),
    (2, 8, {}),
    (11, 7, {"repetition_penalty": 1.3}),
    (6, 5, {"temperature": 1.2, "seed": 2, "min_p": 0.05}),
]


@pytest.mark.parametrize("v", **params(GRID))
def test_requests_arriving_together_are_prefilled_in_one_batch_and_each_equals_generate(v, monkeypatch):
    import torchformer.serve.scheduler as engine_module

    model = build(v, seed=5)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, model.config.vocab_size, (t,), generator=g).tolist() for t, _, _ in TOGETHER]
    batches, real = [], engine_module.prefill_rows
    monkeypatch.setattr(
        engine_module,
        "prefill_rows",
        lambda m, c, start, ps, *rest: (batches.append((start, list(ps))), real(m, c, start, ps, *rest))[1],
    )
    engine = make_engine(model, slots=4)
    sinks = [Collect() for _ in TOGETHER]
    try:
        with engine.wake:  # all queued before the engine admits any
            for prompt, (_, n, sampling), sink in zip(prompts, TOGETHER, sinks):
                engine.submit(prompt, options(n, **sampling), sink)
        assert all(sink.ended.wait(30) for sink in sinks)
    finally:
        engine.stop()
    assert engine.error is None
    assert batches == [(0, sorted(prompts, key=len))], "one prefill, shortest prompt in the lowest row"
    for prompt, (_, n, sampling), sink in zip(prompts, TOGETHER, sinks):
        assert sink.tokens == generate_alone(model, prompt, n, sampling), sampling
        assert sink.end == Done("length", len(prompt), n)


def test_a_request_failing_to_start_leaves_its_batch_mates_exact(tiny, monkeypatch):
    from torchformer.serve.jobs import Job

    real = Job.start

    def start(self, row, vocab_size, device):
        if self.prompt == [9, 9, 9]:  # the poisoned request, in the middle row of the batch
            raise RuntimeError("boom in start")
        return real(self, row, vocab_size, device)

    monkeypatch.setattr(Job, "start", start)
    engine = make_engine(tiny, slots=3)
    prompts = [[1, 2], [9, 9, 9], [4, 5, 6, 7]]
    sinks = [Collect() for _ in prompts]
    try:
        with engine.wake:
            for prompt, sink in zip(prompts, sinks):
                engine.submit(prompt, options(5), sink)
        assert all(sink.ended.wait(10) for sink in sinks)
        assert engine.healthy
    finally:
        engine.stop()
    assert isinstance(sinks[1].end, Failed) and "boom in start" in sinks[1].end.error.message
    for i in (0, 2):
        assert sinks[i].tokens == generate_alone(tiny, prompts[i], 5, {})


def test_a_failing_batched_prefill_fails_its_requests_and_the_engine_goes_on(tiny, monkeypatch):
    import torchformer.serve.scheduler as engine_module

    real, calls = engine_module.prefill_rows, []

    def prefill_rows(*args):
        calls.append(len(args[3]))
        if len(calls) == 1:
            raise RuntimeError("boom in prefill")
        return real(*args)

    monkeypatch.setattr(engine_module, "prefill_rows", prefill_rows)
    engine = make_engine(tiny, slots=2)
    try:
        first = [Collect(), Collect()]
        with engine.wake:
            for sink in first:
                engine.submit([1, 2, 3], options(4), sink)
        assert all(sink.ended.wait(10) for sink in first)
        later = Collect()
        engine.submit([1, 2, 3], options(4), later)
        assert later.ended.wait(10)
    finally:
        engine.stop()
    assert calls[0] == 2, "the two requests shared one prefill"
    assert all(isinstance(s.end, Failed) and s.end.error.status == 500 for s in first)
    assert "boom in prefill" in first[0].end.error.message
    assert later.tokens == generate_alone(tiny, [1, 2, 3], 4, {}) and engine.error is None


def test_prefill_batches_are_runs_of_consecutive_rows_within_the_token_and_padding_limits():
    from torchformer.serve.rows import PAD_SLACK, PREFILL_TOKENS, prefill_batches

    def lengths(*pairs):
        return prefill_batches([(row, [1] * t) for row, t in pairs])

    assert lengths((0, 5), (1, 9), (2, 9)) == [[0, 1, 2]]
    assert lengths((0, 5), (2, 9), (3, 9)) == [[0], [1, 2]]  # row 1 is busy: not one view
    assert lengths((0, 100), (1, 1000)) == [[0], [1]]  # 900 pad tokens for 1100 real ones
    short = PAD_SLACK // 2
    assert lengths((0, 1), (1, short), (2, short)) == [[0, 1, 2]]  # few pads in absolute terms
    big = PREFILL_TOKENS // 2
    assert lengths((0, big), (1, big), (2, big)) == [[0, 1], [2]]  # the token budget
    assert lengths((0, 3)) == [[0]] and lengths() == []


def test_eos_stops_with_finish_reason_stop(tiny):
    prompt = [5, 6, 7]
    greedy = generate_alone(tiny, prompt, 6, {})
    eos = greedy[3]
    cfg = tiny.config.replace(eos_token_id=eos)
    model = tfm.build_model(cfg).eval()
    model.load_state_dict(tiny.state_dict())
    engine = make_engine(model, slots=2)
    try:
        sink = Collect()
        engine.submit(prompt, options(6), sink)
        assert sink.ended.wait(10)
    finally:
        engine.stop()
    first = greedy.index(eos)
    assert sink.tokens == greedy[: first + 1]
    assert sink.end == Done("stop", 3, first + 1)


def test_context_length_and_queue_limits(tiny):
    engine = make_engine(tiny, slots=1, max_queue=1)
    try:
        with pytest.raises(APIError) as err:
            engine.submit([1] * 90, options(10), Collect())
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
        assert "96" in err.value.message and "100" in err.value.message  # the context and the request
        release, blocked = threading.Event(), threading.Event()
        inner = engine.step_fn

        def held(*args):  # keep the one row busy until the test says so
            blocked.set()
            release.wait(10)
            return inner(*args)

        engine.step_fn = held
        first = Collect()
        engine.submit([1, 2], options(3), first)
        assert blocked.wait(10)
        engine.submit([1, 2], options(3), Collect())  # waits: the queue holds one
        with pytest.raises(APIError) as err:
            engine.submit([1, 2], options(3), Collect())
        assert err.value.status == 429 and err.value.code == "queue_full"
        release.set()
        assert first.ended.wait(10)
    finally:
        release.set()
        engine.stop()


def test_request_timeout_ends_with_length(tiny):
    engine = make_engine(tiny, slots=1, request_timeout=0.3)
    try:
        inner = engine.step_fn
        engine.step_fn = lambda *a: (threading.Event().wait(0.05), inner(*a))[1]  # 50 ms per step
        sink = Collect()
        engine.submit([1, 2, 3], options(80), sink)
        assert sink.ended.wait(10)
    finally:
        engine.stop()
    assert sink.end.finish_reason == "length" and 1 <= sink.end.completion_tokens < 80


def test_sampling_error_fails_only_that_request(tiny, monkeypatch):
    import torchformer.serve.jobs as jobs

    real = jobs.choose

    def choose(logits, s, generator):
        if s.top_k == 13:  # the poisoned request
            raise RuntimeError("boom in sampling")
        return real(logits, s, generator)

    monkeypatch.setattr(jobs, "choose", choose)
    engine = make_engine(tiny, slots=2)
    try:
        bad, good = Collect(), Collect()
        engine.submit([1, 2], options(5, temperature=1.0, seed=0, top_k=13), bad)
        engine.submit([1, 2], options(5, temperature=1.0, seed=0, top_k=12), good)
        assert bad.ended.wait(10) and good.ended.wait(10)
        assert isinstance(bad.end, Failed) and bad.end.error.status == 500 and "boom" in bad.end.error.message
        assert good.tokens == generate_alone(tiny, [1, 2], 5, {"temperature": 1.0, "seed": 0, "top_k": 12})
        assert engine.healthy  # it survived
    finally:
        engine.stop()


def test_engine_death_is_reported_and_fails_waiting_requests(tiny):
    engine = make_engine(tiny, slots=1)
    try:

        def die():
            raise SystemError("the engine thread itself breaks")

        release = threading.Event()
        engine.step_fn = lambda *a: (release.wait(10), die())
        first, second = Collect(), Collect()
        engine.submit([1], options(4), first)
        engine.submit([1], options(4), second)
        engine.admit = die  # the loop's own code fails, outside any per-request guard
        release.set()
        assert first.ended.wait(10) and second.ended.wait(10)
        wait_until(lambda: not engine.thread.is_alive(), what="the engine thread to die")
    finally:
        engine.stop()
    assert not engine.healthy and isinstance(engine.error, SystemError)
    assert isinstance(first.end, Failed) and first.end.error.status == 500
    assert isinstance(second.end, Failed) and second.end.error.status == 500
    with pytest.raises(APIError) as err:
        engine.submit([1], options(4), Collect())
    assert err.value.status == 503


def test_loading_is_not_healthy(tiny):
    from torchformer.serve.engine import Engine
    from torchformer.serve.text import Texts

    loaded = threading.Event()
    engine = Engine(lambda: (loaded.wait(10), tiny)[1], lambda vocab: Texts(None, vocab)).start()
    try:
        assert not engine.healthy
        with pytest.raises(APIError) as err:
            engine.submit([1], options(2), Collect())
        assert err.value.status == 503 and "loading" in err.value.message
        loaded.set()
        wait_until(lambda: engine.healthy, what="the engine to load")
    finally:
        loaded.set()
        engine.stop()


def test_engine_arguments_are_checked():
    with pytest.raises(ValueError, match="slots=0"):
        make_engine(None, slots=0)
    with pytest.raises(ValueError, match="request_timeout"):
        make_engine(None, request_timeout=0)


def test_row_bucket_is_the_next_power_of_two_within_the_slots():
    from torchformer.serve.rows import row_bucket, row_buckets

    assert [row_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [row_bucket(n, 5) for n in range(1, 6)] == [1, 2, 4, 4, 5]
    assert row_buckets(8) == [1, 2, 4, 8] and row_buckets(5) == [1, 2, 4, 5] and row_buckets(1) == [1]


@pytest.mark.slow
def test_compiled_step_serves_what_generate_gives(tiny, aot_eager):
    """--compile: each step runs the busy rows rounded up to a power of two (rows.py's row_bucket)
    over the whole cache; one graph per bucket, all made at start-up, and no request compiles.
    Compiled through dynamo and AOT autograd (tests/conftest.py's aot_eager): buckets, graphs and
    guards are the property here; inductor's kernels for the decode step: generation/test_compile.py."""
    import torch._dynamo

    torch._dynamo.utils.counters.clear()
    graphs = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    engine = make_engine(tiny, slots=5, compile=True)
    length = tiny.config.max_seq_len
    at_start = graphs()
    assert at_start == 4 and {rows for rows, _ in engine.views} == {1, 2, 4, 5}  # row_bucket's for 5 slots
    try:
        prompts, n = [[5, 6, 7], [9, 1], [4, 4, 4, 4]], 8
        sinks = [Collect() for _ in prompts]
        for p, sink in zip(prompts, sinks):
            engine.submit(p, options(n), sink)
        for sink in sinks:
            assert sink.ended.wait(300)
        assert (4, length) in engine.views  # three busy rows ran as a 4-row step (row 3 a dummy)
        lates = []
        for seed in (2, 3):  # alone, after the others: row 0, a 1-row step; the second one reuses its graph
            late = Collect()
            engine.submit([3, 2, 1], options(n, temperature=0.7, seed=seed), late)
            assert late.ended.wait(120)
            lates.append((seed, late, graphs()))
    finally:
        engine.stop()
    for p, sink in zip(prompts, sinks):
        assert sink.tokens == generate_alone(tiny, p, n, {})
    for seed, late, _ in lates:
        assert late.tokens == generate_alone(tiny, [3, 2, 1], n, {"temperature": 0.7, "seed": seed})
    assert {rows for rows, _ in engine.views} == {1, 2, 4, 5}
    assert {slots for _, slots in engine.views} == {length}  # compiled: every slot, always
    assert graphs() == len(engine.views) == len(aot_eager) == at_start  # one graph per bucket, none made by a request
    assert lates[0][2] == lates[1][2] == at_start


def test_a_stuck_engine_is_not_healthy(tiny):
    engine = make_engine(tiny, slots=1, stall_timeout=0.3)
    release = threading.Event()
    try:
        inner = engine.step_fn
        engine.step_fn = lambda *a: (release.wait(10), inner(*a))[1]  # a forward that hangs
        sink = Collect()
        engine.submit([1, 2], options(2), sink)
        wait_until(lambda: not engine.healthy, timeout=5, what="the stall to be noticed")
        assert engine.thread.is_alive() and "has not stepped" in engine.state()
        release.set()
        assert sink.ended.wait(10)
        wait_until(lambda: engine.healthy, timeout=5, what="the engine to step again")
        assert engine.state() == "ok"
    finally:
        release.set()
        engine.stop()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_model_serves_what_generate_gives(tiny, scheme):
    """--quantize: the engine runs the quantized linears like generate does (no special path)."""
    model = tfm.quantize(tfm.build_model(tiny.config).eval(), scheme, group_size=None if scheme == "int8" else 32)
    engine = make_engine(model, slots=2)
    try:
        sinks = [Collect(), Collect()]
        engine.submit([5, 6, 7], options(10), sinks[0])
        engine.submit([1, 2], options(10, temperature=0.9, seed=4), sinks[1])
        assert all(s.ended.wait(30) for s in sinks)
    finally:
        engine.stop()
    assert sinks[0].tokens == generate_alone(model, [5, 6, 7], 10, {})
    assert sinks[1].tokens == generate_alone(model, [1, 2], 10, {"temperature": 0.9, "seed": 4})


def test_a_request_whose_end_is_sent_is_no_longer_running(tiny):
    """/metrics' requests_running: the client may read it the moment its answer ends, before the
    engine frees the row; a request counts as running until its end is sent, not until then."""
    engine = make_engine(tiny, slots=2)
    seen = []

    class Watch(Collect):
        def __call__(self, event) -> None:
            if isinstance(event, Done):
                seen.append(engine.running)  # on the engine thread, as the app hands the end on
            super().__call__(event)

    sinks = [Watch(), Watch()]
    try:
        with engine.wake:
            engine.submit([1, 2, 3], options(3), sinks[0])
            engine.submit([4, 5], options(6), sinks[1])
        assert all(sink.ended.wait(30) for sink in sinks)
    finally:
        engine.stop()
    assert seen == [1, 0]  # the longer request still runs when the first ends; then none
