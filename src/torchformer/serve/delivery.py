"""From the engine thread to the client: the Mailbox that carries the engine's events onto the
event loop (one wake-up per engine step), and the SSE body (``sse``, ``EventStream``) of a
streamed answer. app.py turns the events into responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

from starlette.responses import StreamingResponse


def sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


class EventStream(StreamingResponse):
    """An SSE response that cancels its request however it ends: finished (a no-op then),
    disconnected mid-stream, or cancelled before the body generator ever ran."""

    def __init__(self, on_close, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Mailbox:
    """Events from the engine thread to the requests' queues on the event loop. All the events of
    one engine step reach the loop in one wake-up (one call_soon_threadsafe), not one per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.lock, self.pending, self.scheduled = loop, threading.Lock(), [], False

    def post(self, queue: asyncio.Queue, event) -> None:  # on the engine thread
        with self.lock:
            self.pending.append((queue, event))
            if self.scheduled:
                return
            self.scheduled = True
        with contextlib.suppress(RuntimeError):  # the event loop has closed (server shutting down)
            self.loop.call_soon_threadsafe(self.deliver)

    def deliver(self) -> None:  # on the event loop
        with self.lock:
            batch, self.pending, self.scheduled = self.pending, [], False
        for queue, event in batch:
            queue.put_nowait(event)
