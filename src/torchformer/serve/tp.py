"""Tensor-parallel serving (issue 31): rank 0 owns HTTP and scheduling; every rank runs the same
steps on its shard of the model and of the static cache (split by K/V heads, parallel/apply.py).

Rank 0 runs the usual engine (engine.py, scheduler.py) as ``Leader``, which announces each use
of the model and cache to the other ranks before running it: the cache's shape once loaded, a
batched prefill (rows and prompts), a decode step (its (n, 1) ids, positions and live rows), a
row copy (a request's n choices) and an LM head over given hidden states (an echoed prompt's
logprobs). The other ranks run ``follow``: each announcement, the same function (rows.py) on
their shard, so the engine itself has no distributed branch. Only rank 0 samples: the next
step's tokens come from its announcement, so the ranks cannot disagree on them.

Lifetime. When idle, rank 0 announces a tick every TICK seconds, so a follower's wait never
reaches the process group's timeout; when the engine ends (shutdown, or death) it announces
"stop" and the followers return, so stopping the server stops every rank. A rank that dies or
hangs breaks the next collective (gloo: the connection closes; a hung rank: the group's
timeout). A step under TP that fails fails its requests (a 500, as on one process), and at the
next turn of the loop the engine dies of ``RankLost``, which no request handler catches: after a
failed step the ranks' caches need not agree. The server then exits with the error.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..fast.scope import packed
from ..parallel.session import TPSession
from .engine import Engine
from .rows import copy_row, decode_rows, prefill_rows, rows_view

TICK = 5.0  # seconds between an idle rank 0's announcements (the group's timeout is far longer)


class RankLost(BaseException):  # noqa: N818 - not an Exception: the scheduler's per-request handlers let it pass
    """A step under tensor parallelism failed: the ranks may no longer hold the same cache."""


class Leader(Engine):
    """The engine of rank 0 (``Engine``'s arguments after ``session``)."""

    def __init__(self, session: TPSession, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.session, self.said = session, time.monotonic()
        self.lost: RankLost | None = None  # a step failed: the engine dies at its next turn

    def announce(self, header: tuple, tensor: torch.Tensor | None = None) -> None:
        self.session.announce(header, tensor)
        self.said = time.monotonic()

    def mirrored(self, header: tuple, tensor: torch.Tensor | None, run):
        """Announce a step, then run it here. A failure of either fails the step's requests (the
        scheduler catches it) and the engine at its next turn (``drop``); no step runs after it."""
        if self.lost is not None:
            raise RuntimeError(str(self.lost))
        try:
            self.announce(header, tensor)
            return run()
        except Exception as err:
            what = f"the tensor-parallel {header[0]} step failed (did another rank die or hang?): {err}"
            self.lost = RankLost(what)
            raise RuntimeError(what) from err

    def run(self) -> None:
        try:
            super().run()
        finally:  # the followers return; after a failed step, they see rank 0 exit instead
            if self.lost is None:
                with contextlib.suppress(Exception):
                    self.announce(("stop",))

    def loop(self) -> None:
        # Called once loaded, the cache allocated (engine.py run): the followers allocate theirs.
        self.mirrored(("start", self.slots, self.context), None, lambda: None)
        local = self.step_fn

        def step(model, ids, pos, live, view):  # ids, pos, live (n, 1) -> logits (n, V)
            rows = torch.cat([ids, pos, live.to(ids.dtype)], 1)  # (n, 3)
            header = ("decode", ids.shape[0], view.max_len)  # the view: rows 0..n-1, slots 0..max_len-1
            return self.mirrored(header, rows, lambda: local(model, ids, pos, live, view))

        self.step_fn = step
        super().loop()

    def drop(self) -> None:  # once per turn of the engine loop, busy or idle
        if self.lost is not None:
            raise self.lost
        if time.monotonic() - self.said > TICK:
            self.mirrored(("tick",), None, lambda: None)
        super().drop()

    def prefill_rows(self, start: int, prompts: list[list[int]], reused: int):
        header = ("prefill", start, prompts, reused)
        return self.mirrored(header, None, lambda: super(Leader, self).prefill_rows(start, prompts, reused))

    def copy_row(self, src: int, dst: int, length: int) -> None:
        self.mirrored(("copy", src, dst, length), None, lambda: super(Leader, self).copy_row(src, dst, length))

    def head(self, hidden):
        header = ("head", tuple(hidden.shape), str(hidden.dtype).removeprefix("torch."))
        return self.mirrored(header, hidden, lambda: super(Leader, self).head(hidden))


def follow(model, session: TPSession) -> None:
    """Ranks > 0: run every step rank 0 announces, on this rank's shard, until it says stop."""
    cache, views = None, {}
    with torch.inference_mode(), contextlib.ExitStack() as scope:
        while True:
            header = session.receive()
            op, args = header[0], header[1:]
            if op == "stop":
                return
            if op == "start":  # (slots, max_len): the cache, and the packing rank 0 runs under (engine.py)
                cache, views = model.new_cache(batch_size=args[0], max_len=args[1]), {}
                scope.enter_context(packed(model, args[0]))
            elif op == "prefill":
                prefill_rows(model, cache, *args)
            elif op == "decode":
                n, length = args
                rows = session.receive_tensor((n, 3), torch.int64)  # ids, positions, live
                if (n, length) not in views:
                    views[n, length] = rows_view(cache, 0, n, length)
                decode_rows(model, rows[:, :1], rows[:, 1:2], rows[:, 2:].bool(), views[n, length])
            elif op == "copy":
                copy_row(cache, *args)
            elif op == "head":
                shape, dtype = args
                model.lm_head(session.receive_tensor(shape, getattr(torch, dtype)))
            elif op != "tick":
                raise ValueError(f"rank 0 announced {op!r}, which this rank does not know (a version mismatch?)")
