"""How a pagoda HTTP process (`pagoda serve`, `pagoda router`, `pagoda serve --data-parallel-size`)
takes its port and stops: the listening socket bound before anything slow starts, and uvicorn with
pagoda's stop rules. Light (no engine, no torch), so that the router can use it too; the server's
own part (the engine to drain) is pagoda/entrypoints/openai/lifecycle.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn

logger = logging.getLogger("pagoda.server")

# uvicorn's own deadline, a backstop behind the drain: once requests are aborted they end within
# moments, so uvicorn cancels only what still hangs after this much more.
BACKSTOP_SECONDS = 5.0


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (or the router starts) so that a busy
    port fails at once, with a message, before anything is printed as serving. It listens only
    once uvicorn starts: until then a client is refused, not left waiting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e} "
                           "(is another server running there? choose another --port)") from None
    sock.set_inheritable(True)
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn, with pagoda's stop rules: the first SIGTERM / SIGINT stops accepting (the listener
    closes) and lets requests in flight finish for up to `shutdown_timeout` seconds, then aborts
    the rest (`abort_all`: a stream ends with an error event and `data: [DONE]`); a second signal
    aborts everything at once. The process then exits with `exit_code`, not by re-raising the
    signal. Subclasses say what is in flight and how to abort it."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout + BACKSTOP_SECONDS
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0

    # -- what a subclass says --------------------------------------------------------------
    def in_flight(self) -> int:
        """Requests being answered now (for the log)."""
        return 0

    def on_drain(self) -> None:
        """The first stop signal: stop taking new work (called from the signal handler)."""

    def abort_all(self) -> int:
        """End everything still in flight now (on the event loop); returns how many."""
        return 0

    def on_hurry(self) -> None:
        """A second stop signal (called from the signal handler, after `abort_all` is scheduled)."""

    # -- the rules ---------------------------------------------------------------------------
    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            logger.warning("%s again: aborting %d request(s) and exiting now", name, self.in_flight())
            self.force_exit = True
            self.call_soon(self._abort_all)
            self.on_hurry()
            return
        self.should_exit = True
        logger.warning("%s: shutting down; %d request(s) in flight get up to %gs to finish (a second signal stops "
                       "at once)", name, self.in_flight(), self.shutdown_timeout)
        self.on_drain()
        self.call_soon(lambda: self._loop.call_later(self.shutdown_timeout, self._abort_all))

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the server's event loop (safe from a signal handler or another thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn)

    def _abort_all(self) -> None:
        ended = self.abort_all()
        if ended:
            logger.warning("aborted %d request(s) at shutdown", ended)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the app's shutdown after a second signal; its lifespan task, cancelled
            # at exit instead, printed a CancelledError traceback. The apps' shutdowns are quick.
            await self.lifespan.shutdown()

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without re-raising the signal afterwards (which would make the exit status
        a signal's instead of 0 after a clean drain)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
