"""One engine replica of a Ray Serve deployment: pagoda's AsyncLLM and its OpenAI app in a Ray
actor (the Serve replica), called by the ingress with a request as data (asgi_bridge.py).

A replica is what one `pagoda serve` process is, less the HTTP server: the same `build_app`
over the same engine, so every API, limit and metric behaves as it does there. With
`tensor_parallel_size` N > 1 the deployment reserves N bundles per replica (app.py), the replica
runs in the first and the Ray executor places ranks 1..N-1 in the others
(pagoda/executor/ray.py uses the placement group it runs in).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from pagoda.config import create_engine_config
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine_args import EngineArgs
from pagoda.entrypoints.openai.api_server import build_app
from pagoda.entrypoints.openai.durable import DurableOptions
from pagoda.ray_serve.asgi_bridge import Head, HTTPCall, Lifespan, play
from pagoda.router.affinity import RouteRequest

logger = logging.getLogger("pagoda.ray_serve")

REPLICA_HEADER = b"x-pagoda-replica"  # names the replica that answered, as the router's x-pagoda-worker


@dataclass(frozen=True)
class ServerOptions:
    """The server's side of `pagoda serve`'s options that a replica's app takes."""

    served_model_names: list[str]
    api_key: str | None = None
    max_queue_len: int | None = None
    request_timeout: float | None = None
    web_ui: bool = True
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


class EngineReplica:
    """The replica deployment's class (app.py wraps it in `serve.deployment`)."""

    def __init__(self, engine_args: EngineArgs, options: ServerOptions) -> None:
        self._started: asyncio.Task | None = None  # first: __del__ runs after a constructor that raised too
        self.engine: AsyncLLM | None = None
        self.engine = AsyncLLM(create_engine_config(engine_args))
        # the state (sessions, stored responses, batches) in a temporary directory a replica:
        # Serve may start and stop replicas anywhere, so there is nothing on disk to come back to
        self.app = build_app(self.engine, options.served_model_names, api_key=options.api_key,
                             max_queue_len=options.max_queue_len, model_root=engine_args.model,
                             request_timeout=options.request_timeout, durable=DurableOptions(None),
                             web_ui=options.web_ui, reasoning_parser=options.reasoning_parser,
                             tool_call_parser=options.tool_call_parser)
        # Serve counts a replica ready once its constructor returns: with --progressive-load that
        # stays "every layer in place", as /health's default (entrypoints/openai/loading.py)
        self.engine.wait_until_loaded()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._lifespan = Lifespan(self.app)
        logger.info("pagoda replica %s: %s loaded", self.replica_id, engine_args.model)

    async def _start(self) -> None:
        """The app's startup handlers, once, on the replica's event loop (the constructor has none)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._lifespan.startup())
        await asyncio.shield(self._started)

    async def forward(self, route: RouteRequest, call: HTTPCall) -> AsyncIterator[Head | bytes]:
        """Serve one request: its `Head`, then its body's chunks. `route` is not read here: it is
        the first argument so that the request router (request_router.py) reads it."""
        await self._start()
        async for item in play(self.app, call, [(REPLICA_HEADER, self.replica_id.encode())]):
            yield item

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine is dead (a tensor-parallel rank died, the
        core raised) fails it, and Serve replaces the replica."""
        if self.engine is None or not self.engine.healthy:
            raise RuntimeError(f"pagoda engine is not running: {self.engine.dead_error}")

    async def __del__(self) -> None:
        """Serve stops the replica (scaled down, or the app deleted): the app's shutdown handlers
        (the state database, its temporary directory), then the engine."""
        if self._started is not None:
            await self._lifespan.shutdown()
        if self.engine is not None:
            self.engine.shutdown()
