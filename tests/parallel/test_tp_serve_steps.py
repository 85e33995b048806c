"""Issue 31: the steps of ``serve --tp`` (serve/tp.py) in one process, no torch.distributed. Rank
0's engine (``Leader``) announces into a queue that ``follow`` reads on a thread, over a second
copy of the same model: after concurrent requests of every kind (prefill, decode, n=2 row copies,
an echoed prompt's head, a prefix reused) both caches are bit-identical, so every write to the
cache is announced. A step that fails (a rank gone) fails its requests with a 500 and then the
engine, which /health and the server's exit report; no further step is sent."""

from __future__ import annotations

import copy
import queue
import threading

import torch

from tests.serve.conftest import Running, httpx, wait_until
from torchformer.serve.app import create_app
from torchformer.serve.text import Texts
from torchformer.serve.tp import Leader, RankLost, follow

from .test_tp_serve import ask, bodies, case, together  # noqa: F401 - case: the saved model fixture


class Pipe:
    """A TPSession's announce / receive over a queue (rank 0 and one follower in one process)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.sent: list[str] = []
        self.fail_after, self.tensor = fail_after, None

    def announce(self, header, tensor=None) -> None:
        if self.fail_after is not None and len(self.sent) >= self.fail_after:
            raise RuntimeError("Connection reset by peer")  # what gloo says of a rank that died
        self.sent.append(header[0])
        self.queue.put((header, None if tensor is None else tensor.clone()))

    def receive(self):
        item = self.queue.get(timeout=60)
        if item is None:
            raise RuntimeError("Connection closed by peer")  # what gloo says once rank 0 is gone
        header, self.tensor = item
        return header

    def hang_up(self) -> None:
        """Rank 0's process ends: the follower's next receive fails."""
        self.queue.put(None)

    def receive_tensor(self, shape, dtype):
        assert tuple(self.tensor.shape) == tuple(shape) and self.tensor.dtype == dtype
        return self.tensor


def leader(model, pipe: Pipe) -> Leader:
    engine = Leader(pipe, lambda: model, lambda vocab: Texts(None, vocab), slots=4).start()
    wait_until(lambda: engine.healthy or engine.error is not None, timeout=60, what="the engine to load")
    return engine


def test_every_cache_write_is_announced(case):  # noqa: F811
    _, model, prompt = case
    pipe, other = Pipe(), copy.deepcopy(model)
    caches = []
    other.new_cache = lambda **kw: caches.append(type(model).new_cache(other, **kw)) or caches[-1]
    follower = threading.Thread(target=follow, args=(other, pipe), daemon=True)
    follower.start()
    engine = leader(model, pipe)
    running = Running(create_app(engine, "m", None))
    try:
        requests = bodies(prompt)
        together(running.url, requests)
        first = ask(running.url, requests[1])
        again = ask(running.url, {**requests[1], "prompt": requests[1]["prompt"] + first[0]["ids"][:4]})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # a prefill at an offset
    finally:
        running.stop()
        engine.stop()
    follower.join(30)
    assert not follower.is_alive(), "the follower did not stop with rank 0"
    assert {"start", "prefill", "decode", "copy", "head", "stop"} <= set(pipe.sent), pipe.sent
    (theirs,) = caches
    for i, (a, b) in enumerate(zip(engine.cache.layers, theirs.layers)):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v), f"layer {i}: the caches differ"


def test_a_failed_step_fails_its_requests_then_the_engine(case):  # noqa: F811
    _, model, prompt = case
    pipe, ended = Pipe(fail_after=3), []  # start, a prefill, one decode step: then the "rank" is gone

    def follower_until_rank_0_ends():
        try:
            follow(copy.deepcopy(model), pipe)
        except RuntimeError as err:
            ended.append(str(err))

    follower = threading.Thread(target=follower_until_rank_0_ends, daemon=True)
    follower.start()
    engine = leader(model, pipe)
    running = Running(create_app(engine, "m", None))
    try:
        answer = httpx.post(f"{running.url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 8},
                            timeout=60)  # fmt: skip
        assert answer.status_code == 500, answer.text
        assert (
            "the tensor-parallel decode step failed (did another rank die or hang?)"
            in answer.json()["error"]["message"]
        )
        wait_until(lambda: not engine.thread.is_alive(), timeout=30, what="the engine to die")
        assert isinstance(engine.error, RankLost)
        assert httpx.get(f"{running.url}/health").status_code == 503
    finally:
        running.stop()
        engine.stop()
        pipe.hang_up()  # the follower waits for a step that never comes until rank 0's process ends
        follower.join(30)
    assert pipe.sent == ["start", "prefill", "decode"]  # nothing after the failure, no "stop" either
    assert not follower.is_alive() and ended == ["Connection closed by peer"]
