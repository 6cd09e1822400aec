"""How the server starts and stops: the listening socket bound before the model loads, and the
signal handling that drains requests before exiting (README, "Operating pagoda"); the stop rules
themselves, shared with the router, are pagoda/entrypoints/graceful.py. Noticing a client that
leaves: pagoda/entrypoints/disconnect.py."""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi import FastAPI

from pagoda.engine.async_llm import AsyncLLM, ShuttingDownError
from pagoda.entrypoints.graceful import GracefulServer, bind_listener  # bind_listener: serve's, from here
from pagoda.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("pagoda.server")


class Lifecycle:
    """The server's shutdown state, shared by the routes and the signal handling."""

    def __init__(self) -> None:
        self.draining = False  # a stop signal came: new requests get 503, in-flight ones finish


def shutting_down() -> OpenAIError:
    return OpenAIError("the server is shutting down", status=503, type_="server_error", code="shutting_down")


def check_serving(lifecycle: Lifecycle, engine: AsyncLLM) -> None:
    """503 for a new request while the server drains or its engine is restarting or dead."""
    if lifecycle.draining:
        raise shutting_down()
    if not engine.healthy:
        state = "restarting" if engine.restarting else f"not running: {engine.dead_error}"
        raise OpenAIError(f"engine is {state}", status=503, type_="server_error", code="engine_dead")


class DrainingServer(GracefulServer):
    """`pagoda serve`'s uvicorn: GracefulServer's stop rules over the engine's requests. The first
    signal also makes requests on open connections get 503; an engine failure stops the server."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, engine: AsyncLLM, shutdown_timeout: float) -> None:
        super().__init__(config, shutdown_timeout)
        self.app_state, self.engine = app.state, engine
        engine.on_fatal = self.stop_after_engine_failure

    async def serve(self, sockets=None) -> None:
        # a model that loads layer by layer may fail once the server listens: the engine then
        # reports to this loop (before any request gave it one), and the server stops
        watch = getattr(self.engine, "watch_failures", None)
        if watch is not None:
            watch(asyncio.get_running_loop())
        await super().serve(sockets)

    def in_flight(self) -> int:
        return self.engine.num_pending

    def on_drain(self) -> None:
        self.app_state.lifecycle.draining = True

    def abort_all(self) -> int:
        return self.engine.abort_all(ShuttingDownError("the server is shutting down: request aborted"))

    def stop_after_engine_failure(self, error: BaseException) -> None:
        """The engine cannot go on (a tensor-parallel worker died): its requests have failed with
        503; stop serving and exit non-zero, so that a supervisor restarts the whole server."""
        logger.error("engine failed (%s): the server stops", error)
        self.app_state.lifecycle.draining = True
        self.exit_code = 1
        self.should_exit = True
