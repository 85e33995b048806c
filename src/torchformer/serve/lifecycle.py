"""The server as a process: uvicorn over the app, a bounded graceful shutdown, and an exit when
the engine thread dies (a supervisor restarts a process; it cannot fix one answering 503).

On SIGTERM or SIGINT uvicorn stops listening and waits for open connections; before that wait,
``Process.shutdown`` closes the app (``Server.close``): body reads still in progress answer 503,
the engine admits nothing more and ends the requests still running after ``grace`` seconds with
a 503 (an error event, then [DONE], on a stream). So the wait is bounded by ``grace`` and the
process exits 0. uvicorn's own timeout (a little later) is only a backstop.
"""

from __future__ import annotations

import signal

import uvicorn

from .engine import Engine

BACKSTOP = 2.0  # seconds after the grace before uvicorn cancels what is left (it logs each as an error)


class Process(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: Engine, close, grace: float) -> None:
        super().__init__(config)
        self.engine, self.close, self.grace = engine, close, grace

    async def on_tick(self, counter: int) -> bool:
        if not self.engine.thread.is_alive():  # the model did not load, or the engine died
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        self.close(self.grace)
        await super().shutdown(sockets)


def serve(app, engine: Engine, *, host: str, port: int, log_level: str, grace: float) -> None:
    """Serve ``app`` (create_app's) until a signal or the engine's death; returns after shutdown."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace + BACKSTOP)
    process = Process(config, engine, app.server.close, grace)
    # uvicorn raises the signal that stopped it again once it has shut down, to end the process
    # with the signal's default action (killed by SIGTERM). A stop that was asked for and went
    # cleanly is a success: under these no-op handlers, which uvicorn restores first, the process
    # goes on to exit 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        process.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
