"""The router's process: its HTTP app (the proxied routes, health, metrics, the admin routes for
workers), its listening socket (bound before anything is printed, so a busy port fails at once
with a message) and its stop rules, shared with `pagoda serve` (pagoda/entrypoints/graceful.py):
a stop signal gives open requests `--shutdown-timeout` seconds, then ends open streams with a
`shutting_down` error event and `data: [DONE]`, and answers the rest 503 `shutting_down`."""

from __future__ import annotations

import contextlib
import logging
import secrets

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagoda import __version__
from pagoda.entrypoints.graceful import GracefulServer, bind_listener
from pagoda.router.app import Router
from pagoda.router.config import RouterConfig
from pagoda.router.proxy import OpenAIErrorResponse
from pagoda.router.workers import normalize_url

logger = logging.getLogger("pagoda.router")

SHUTDOWN_MESSAGE = "the router is shutting down: request aborted"


class RouterServer(GracefulServer):
    """uvicorn for the router: what is in flight is the gateway's count; aborting ends open
    streams with an error event and `data: [DONE]` and answers the rest 503 (Router.abort_all)."""

    def __init__(self, config: uvicorn.Config, router: Router, shutdown_timeout: float) -> None:
        super().__init__(config, shutdown_timeout)
        self.router = router

    def in_flight(self) -> int:
        return self.router.limits.in_flight

    def abort_all(self) -> int:
        return self.router.abort_all(SHUTDOWN_MESSAGE)


def run_router(config: RouterConfig, host: str, port: int, log_level: str, shutdown_timeout: float) -> int:
    """`pagoda router`: until SIGINT / SIGTERM; returns the exit status."""
    sock = bind_listener(host, port)  # a busy port fails here, before the banner
    if not config.workers and not config.discover:
        logger.warning("starting with no workers: add them with POST /workers (or give --discover)")
    try:
        app = build_app(config)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request otherwise
        print(f"pagoda {__version__}: router ({config.policy}) for {len(config.workers)} worker(s) on "
              f"http://{host}:{port}/v1", flush=True)
        server = RouterServer(uvicorn.Config(app, log_level=log_level, access_log=False), app.state.router,
                              shutdown_timeout)
        server.run(sockets=[sock])
    finally:
        sock.close()
    print("pagoda: router stopped", flush=True)
    return server.exit_code


def build_app(config: RouterConfig) -> Starlette:
    router = Router(config)

    def admin_refusal(request: Request) -> Response | None:
        if not config.admin_key:
            return OpenAIErrorResponse("admin routes are off: start the router with --admin-key", 403,
                                       "permission_error", "admin_disabled")
        if not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {config.admin_key}"):
            return OpenAIErrorResponse("invalid or missing admin key", 401, "authentication_error", "invalid_api_key")
        return None

    async def proxied(request: Request) -> Response:
        query = request.url.query
        return await router.forward(request, request.url.path + (f"?{query}" if query else ""))

    async def models(request: Request) -> Response:
        return await router.models(request)

    async def health(_request: Request) -> Response:
        return router.health()

    async def metrics(_request: Request) -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def version(_request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def list_workers(request: Request) -> Response:
        return admin_refusal(request) or JSONResponse(router.describe())

    async def worker_url(request: Request) -> str | Response:
        """The worker URL an admin request names, or the answer that refuses it."""
        if (refusal := admin_refusal(request)) is not None:
            return refusal
        try:
            return normalize_url(await _url_from(request))
        except ValueError as e:
            return OpenAIErrorResponse(str(e), 400, "invalid_request_error", "invalid_worker_url")

    async def add_worker(request: Request) -> Response:
        if isinstance(url := await worker_url(request), Response):
            return url
        known = router.registry.get(url) is not None
        worker = router.add_worker(url)
        if not known:
            assert router.client is not None
            await router.registry.probe(worker, router.client)  # warm-up starts once it answers
        return JSONResponse(worker.describe(), status_code=200 if known else 201)

    async def remove_worker(request: Request) -> Response:
        if isinstance(url := await worker_url(request), Response):
            return url
        if not router.remove_worker(url):
            return OpenAIErrorResponse(f"no worker {url}", 404, "invalid_request_error", "worker_not_found")
        return JSONResponse({"removed": url})

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/workers", list_workers, methods=["GET"]),
        Route("/workers", add_worker, methods=["POST"]),
        Route("/workers", remove_worker, methods=["DELETE"]),
        Route("/v1/sessions/{path:path}", proxied, methods=["GET", "POST", "DELETE"]),  # one replica's sessions
        Route("/v1/{path:path}", proxied, methods=["POST"]),
        # stored responses, files and batch jobs: at the replica that keeps them (homes.py)
        Route("/v1/{path:path}", proxied, methods=["GET", "DELETE"]),
        Route("/tokenize", proxied, methods=["POST"]),
        Route("/detokenize", proxied, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = router
    return app


async def _url_from(request: Request) -> str:
    """A worker URL from the body ({"url": ...}) or the query (?url=...)."""
    if url := request.query_params.get("url"):
        return url
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("url"), str):
        return body["url"]
    raise ValueError('give the worker as {"url": "http://HOST:PORT"} or ?url=')


__all__ = ["RouterServer", "build_app", "run_router"]
