"""Admission: the waiting requests and the engine's capacity, shared by the app's threads and the
engine thread under one condition (``wake``).

The capacity is the rows plus ``max_queue``: a request is refused (429) only when every row is
busy and ``max_queue`` requests wait. Requests submitted while rows are free but before the
engine has moved them in are not waiting, they are about to run; so what is counted is the
requests in the queue plus those holding a row (``held``: taken from the queue, not yet given
back), against ``slots + max_queue``. Every way a taken request ends gives its row back once.
"""

from __future__ import annotations

import collections
import threading

from .jobs import Job
from .protocol import APIError, shutting_down


class Admission:
    def __init__(self, slots: int, max_queue: int) -> None:
        self.slots, self.max_queue = slots, max_queue
        self.wake = threading.Condition()
        self.waiting: collections.deque[Job] = collections.deque()
        self.held = 0  # requests taken from the queue that hold, or are about to hold, a row
        self.closed = False

    def put(self, job: Job) -> None:
        with self.wake:
            if self.closed:
                raise shutting_down()
            if len(self.waiting) + self.held >= self.slots + self.max_queue:
                raise APIError(
                    429,
                    f"every row is busy ({self.slots} rows) and the queue is full ({self.max_queue} waiting "
                    "requests): retry later",
                    type="rate_limit_error",
                    code="queue_full",
                )
            self.waiting.append(job)
            self.wake.notify_all()

    def take(self, free: int) -> list[Job]:
        """Up to ``free`` waiting requests, FIFO; each holds a row until ``give_back``."""
        with self.wake:
            jobs = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
            self.held += len(jobs)
        return jobs

    def give_back(self) -> None:
        with self.wake:
            assert self.held > 0, "a row given back twice"
            self.held -= 1

    def close(self) -> list[Job]:
        """Admit nothing more; the waiting requests, for the engine to end."""
        with self.wake:
            self.closed = True
            jobs, self.waiting = list(self.waiting), collections.deque()
            self.wake.notify_all()
        return jobs

    def clear(self) -> list[Job]:
        """Everything waiting, and no row held any more (the engine is gone)."""
        with self.wake:
            jobs, self.waiting, self.held = list(self.waiting), collections.deque(), 0
        return jobs
