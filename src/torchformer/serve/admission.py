"""Admission: the waiting requests and the engine's capacity, shared by the app's threads and the
engine thread under one condition (``wake``).

The capacity is the rows plus ``max_queue``: a request is refused (429) only when every row is
busy and ``max_queue`` requests wait. Requests submitted while rows are free but before the
engine has moved them in are not waiting, they are about to run; so what is counted is the
requests in the queue plus those holding a row (``held``: taken from the queue, not yet given
back), against ``slots + max_queue``. Every way a taken request ends gives its row back once.
A request for n choices is a group of n jobs, counted as n, taken whole or not at all (FIFO: a
group that does not fit the free rows waits, and so do the requests behind it).
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
        self.waiting: collections.deque[list[Job]] = collections.deque()  # groups (requests)
        self.queued = 0  # jobs in ``waiting``
        self.held = 0  # requests taken from the queue that hold, or are about to hold, a row
        self.closed = False

    def put(self, group: list[Job]) -> None:
        with self.wake:
            if self.closed:
                raise shutting_down()
            if self.queued + self.held + len(group) > self.slots + self.max_queue:
                raise APIError(
                    429,
                    f"every row is busy ({self.slots} rows) and the queue is full ({self.max_queue} waiting "
                    "requests): retry later",
                    type="rate_limit_error",
                    code="queue_full",
                )
            self.waiting.append(group)
            self.queued += len(group)
            self.wake.notify_all()

    def take(self, free: int) -> list[list[Job]]:
        """Waiting groups, FIFO, while they fit in ``free`` rows; each job holds a row until
        ``give_back``."""
        groups = []
        with self.wake:
            while self.waiting and len(self.waiting[0]) <= free:
                groups.append(self.waiting.popleft())
                free -= len(groups[-1])
                self.queued -= len(groups[-1])
                self.held += len(groups[-1])
        return groups

    def give_back(self) -> None:
        with self.wake:
            assert self.held > 0, "a row given back twice"
            self.held -= 1

    def close(self) -> list[Job]:
        """Admit nothing more; the waiting requests, for the engine to end."""
        with self.wake:
            self.closed = True
            jobs, self.waiting, self.queued = [j for g in self.waiting for j in g], collections.deque(), 0
            self.wake.notify_all()
        return jobs

    def clear(self) -> list[Job]:
        """Everything waiting, and no row held any more (the engine is gone)."""
        with self.wake:
            jobs, self.waiting, self.held = [j for g in self.waiting for j in g], collections.deque(), 0
            self.queued = 0
        return jobs
