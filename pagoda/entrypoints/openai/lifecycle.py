"""How the server starts and stops: the listening socket bound before the model loads, and the
signal handling that drains requests before exiting (README, "Operating pagoda"). Noticing a
client that leaves: pagoda/entrypoints/disconnect.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading

import uvicorn
from fastapi import FastAPI

from pagoda.engine.async_llm import AsyncLLM, ShuttingDownError
from pagoda.entrypoints.openai.serving import OpenAIError

logger = logging.getLogger("pagoda.server")


class Lifecycle:
    """The server's shutdown state, shared by the routes and the signal handling."""

    def __init__(self) -> None:
        self.draining = False  # a stop signal came: new requests get 503, in-flight ones finish


def shutting_down() -> OpenAIError:
    return OpenAIError("the server is shutting down", status=503, type_="server_error", code="shutting_down")




def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a busy port fails at once
    (not after a minute of loading). It listens only once uvicorn starts: until then a client
    is refused, not left waiting."""
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


class DrainingServer(uvicorn.Server):
    """uvicorn, with pagoda's stop rules: the first SIGTERM / SIGINT stops accepting (the listener
    closes; requests on open connections get 503) and lets requests in flight finish for up to
    `shutdown_timeout` seconds, then aborts the rest (streams end with an error event); a second
    signal aborts everything at once. The process then exits 0, not by re-raising the signal."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, engine: AsyncLLM, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.app_state, self.engine, self.shutdown_timeout = app.state, engine, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0
        engine.on_fatal = self.stop_after_engine_failure

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            logger.warning("%s again: aborting %d request(s) and exiting now", name, self.engine.num_pending)
            self.force_exit = True
            self._call(self._abort_all)
            return
        self.should_exit = True
        pending = self.engine.num_pending
        logger.warning("%s: shutting down; %d request(s) in flight get up to %gs to finish (a second signal stops "
                       "at once)", name, pending, self.shutdown_timeout)
        self.app_state.lifecycle.draining = True
        self._call(lambda: self._loop.call_later(self.shutdown_timeout, self._abort_all))

    def stop_after_engine_failure(self, error: BaseException) -> None:
        """The engine cannot go on (a tensor-parallel worker died): its requests have failed with
        503; stop serving and exit non-zero, so that a supervisor restarts the whole server."""
        logger.error("engine failed (%s): the server stops", error)
        self.app_state.lifecycle.draining = True
        self.exit_code = 1
        self.should_exit = True

    def _call(self, fn) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn)

    def _abort_all(self) -> None:
        ended = self.engine.abort_all(ShuttingDownError("the server is shutting down: request aborted"))
        if ended:
            logger.warning("aborted %d request(s) at shutdown", ended)

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
