"""Work the engine thread runs for the app between its steps (embedding batches): the model is the
engine's alone, so a forward asked for by another thread is queued here and run there, and its
result comes back through a ``concurrent.futures.Future`` (the app awaits it with
``asyncio.wrap_future``). Bounded: more than ``limit`` calls waiting is a 429."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future

from .protocol import APIError


class Calls:
    def __init__(self, wake: threading.Condition, limit: int) -> None:
        self.wake, self.limit = wake, limit
        self.pending: collections.deque[tuple[Callable[[], object], Future]] = collections.deque()

    def __len__(self) -> int:
        return len(self.pending)

    def put(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        with self.wake:
            if len(self.pending) >= self.limit:
                raise APIError(
                    429, f"{self.limit} requests are waiting: retry later", type="rate_limit_error", code="queue_full"
                )
            self.pending.append((fn, future))
            self.wake.notify_all()
        return future

    def run(self) -> None:
        """On the engine thread: every call waiting now; an exception goes to its caller."""
        while True:
            with self.wake:
                if not self.pending:
                    return
                fn, future = self.pending.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as err:  # noqa: BLE001 - this request fails; the engine goes on
                future.set_exception(err)

    def fail_all(self, error: APIError) -> None:
        with self.wake:
            pending, self.pending = list(self.pending), collections.deque()
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
