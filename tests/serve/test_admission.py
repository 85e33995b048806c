"""Issue 26, item 3: a request is refused with 429 only when every row is busy and the queue
holds --max-queue requests. Requests the engine has not yet moved into free rows are not
"waiting": they are about to run. The engine's admission is held (gated) so that what the
requests race against is fixed, not left to timing."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.conftest import NAME, client, make_engine, serving
from tests.serve.test_engine import Collect, options
from torchformer.serve.protocol import APIError


def gate(engine) -> threading.Event:
    """Hold the engine before it admits anything; set the returned event to let it go on."""
    opened, admit = threading.Event(), engine.admit
    engine.admit = lambda: (opened.wait(10), admit())
    return opened


@pytest.mark.parametrize(("slots", "max_queue"), [(4, 0), (4, 2), (1, 0), (2, 3)])
def test_free_rows_and_the_queue_are_the_capacity(tiny, slots, max_queue):
    engine = make_engine(tiny, slots=slots, max_queue=max_queue)
    opened = gate(engine)
    try:
        sinks = [Collect() for _ in range(slots + max_queue)]
        for sink in sinks:  # none admitted yet: each takes a free row or a queue place
            engine.submit([1, 2, 3], options(3), sink)
        with pytest.raises(APIError) as err:
            engine.submit([1, 2, 3], options(3), Collect())
        assert err.value.status == 429 and err.value.code == "queue_full"
        assert str(max_queue) in err.value.message and str(slots) in err.value.message
        opened.set()
        assert all(sink.ended.wait(10) for sink in sinks)
        assert all(sink.end.finish_reason == "length" for sink in sinks)
        # All rows free again: the whole capacity is back.
        more = [Collect() for _ in range(slots + max_queue)]
        with engine.wake:  # queued together, before the engine takes any
            for sink in more:
                engine.submit([4, 5], options(2), sink)
        assert all(sink.ended.wait(10) for sink in more)
    finally:
        opened.set()
        engine.stop()
    assert engine.error is None


def test_every_way_a_request_ends_gives_its_row_back(tiny):
    """Cancelled in the queue, cancelled in a row, finished at its first token, failed at start:
    the capacity counts none of them afterwards."""
    engine = make_engine(tiny, slots=2, max_queue=0)
    opened = gate(engine)
    try:
        cancelled, first_token = Collect(), Collect()
        job = engine.submit([1, 2], options(50), cancelled)
        engine.submit([1, 2], options(1), first_token)
        engine.cancel(job)
        opened.set()
        assert first_token.ended.wait(10)
        failing = Collect()
        bad = engine.submit([1, 2], options(5), failing)
        bad.start = lambda *a: (_ for _ in ()).throw(RuntimeError("start fails"))
        assert failing.ended.wait(10) and failing.end.error.status == 500
        ends = [Collect(), Collect()]
        for sink in ends:
            engine.submit([3], options(2), sink)
        assert all(sink.ended.wait(10) for sink in ends)
    finally:
        opened.set()
        engine.stop()
    assert engine.error is None


def test_an_idle_server_serves_as_many_requests_as_rows_with_max_queue_0(model_dir, tiny):
    with serving(model_dir, tiny, slots=4, max_queue=0) as (engine, url):
        opened = gate(engine)
        c = client(url)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(c.completions.create, model=NAME, prompt="the", max_tokens=3) for _ in range(4)]
            threading.Timer(0.3, opened.set).start()
            outs = [f.result(timeout=30) for f in futures]
        assert [out.usage.completion_tokens for out in outs] == [3, 3, 3, 3]
