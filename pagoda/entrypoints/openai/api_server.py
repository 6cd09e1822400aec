"""`pagoda serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import Coroutine
from typing import Any

import uvicorn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda import __version__
from pagoda.engine.async_llm import AsyncLLM, ShuttingDownError
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, describe_validation_errors, now,
)
from pagoda.entrypoints.openai.serving import OpenAIError, Serving, bad_value, dumps

logger = logging.getLogger("pagoda.server")

_OPEN_PATHS = {"/health", "/version", "/metrics", "/docs", "/openapi.json"}

# The largest request body taken: far above any prompt a context holds (a 128k-token prompt as
# token ids is ~1 MB of JSON), low enough that parsing and refusing one costs about a second
# (16 MB of token ids: 0.6 s here, tests/entrypoints/test_errors.py).
MAX_BODY_BYTES = 32 * 1024 * 1024


class FastJSONResponse(JSONResponse):
    """JSON bodies written by orjson (serving.dumps): 6-7x faster than json.dumps on our bodies."""

    def render(self, content) -> bytes:
        return dumps(content)


def _error(e: OpenAIError) -> JSONResponse:
    return FastJSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _APIKeyCheck:
    """401 for a request without `Authorization: Bearer <key>`, except on the open paths.

    A plain ASGI middleware, installed only when a key is set: Starlette's `@app.middleware("http")`
    (BaseHTTPMiddleware) relays every streamed chunk through a memory stream and a task of its own,
    which added ~70 % to the event loop's time per streamed token (benchmarks/README.md, "Server
    cost per token")."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "")
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError("invalid or missing API key", status=401, type_="authentication_error",
                                    code="invalid_api_key")
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Lifecycle:
    """The server's shutdown state, shared by the routes and the signal handling."""

    def __init__(self) -> None:
        self.draining = False  # a stop signal came: new requests get 503, in-flight ones finish


def _shutting_down() -> OpenAIError:
    return OpenAIError("the server is shutting down", status=503, type_="server_error", code="shutting_down")


_GONE = object()


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Any]):
    """Await `work`, cancelling it (which aborts its engine requests and frees their KV blocks)
    if the client disconnects first; returns `_GONE` then. The body has been read by now, so
    the next ASGI message is `http.disconnect`, sent when the connection is lost."""
    task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)  # let its cleanup (the abort) run
        logger.info("client disconnected: request cancelled")
        return _GONE
    return task.result()


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when the streamed body passes the limit. An HTTPException, so that
    FastAPI's body reading lets it through to the handler (any other error there becomes a 400)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(status_code=413, detail=f"the request body is larger than the server's limit of "
                                                 f"{max_bytes} bytes")


class _BodyLimit:
    """413 for a request body over `max_bytes`: before reading it when Content-Length says so, else
    as soon as the bytes received (a chunked body) pass the limit. A plain ASGI middleware, for
    the reason given at _APIKeyCheck."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await _http_error(scope, _BodyTooLarge(self.max_bytes))(scope, receive, send)
            return
        received, started = 0, False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _BodyTooLarge as e:  # read outside a route's body parsing, which hands it to the handler
            if started:
                raise
            await _http_error(scope, e)(scope, receive, send)


def _http_error(scope: Scope, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's HTTP errors (no such route, wrong method, unreadable or oversized body) as
    OpenAI-style bodies instead of `{"detail": ...}`."""
    method, path = scope.get("method", ""), scope.get("path", "")
    message = {404: f"Invalid URL ({method} {path})",
               405: f"Method {method} not allowed on {path}"}.get(e.status_code, str(e.detail))
    if e.status_code == 400 and message == "There was an error parsing the body":
        message = _unparsable_body(e.__cause__)
    server_side = e.status_code >= 500
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
    return _error(OpenAIError(message, status=e.status_code, type_="server_error" if server_side else
                              "invalid_request_error", code=code, headers=dict(e.headers or {})))


def _unparsable_body(cause: BaseException | None) -> str:
    """Why FastAPI could not read the body as JSON (it says only that it could not)."""
    if isinstance(cause, RecursionError):
        return "the body is not valid JSON: it is nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return "the body is not valid JSON: it is not UTF-8 text"
    return "the body is not valid JSON"


def _catalog_aliases(model_root: str | None, served_model_names: list[str]) -> list[str]:
    """Other names of the served model: a catalog model's name and aliases, when `--model` (a
    catalog name, or the path of the catalog's own file) or a served name is a catalog model."""
    from pathlib import Path

    from pagoda.loader import catalog

    entries = [catalog.resolve_catalog_name(name) for name in [model_root or "", *served_model_names]]
    if model_root:
        given = Path(model_root).expanduser()
        entries += [e for e in catalog.CATALOG if given in (catalog.model_path(e), catalog.model_path(e).parent)]
    return [name for e in dict.fromkeys(e for e in entries if e is not None) for name in (e.name, *e.aliases)]


def build_app(engine: AsyncLLM, served_model_names: list[str], *, api_key: str | None = None,
              max_queue_len: int | None = None, model_root: str | None = None,
              request_timeout: float | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="pagoda", version=__version__, default_response_class=FastJSONResponse)
    serving = Serving(engine, served_model_names, max_queue_len,
                      aliases=_catalog_aliases(model_root, served_model_names))
    serving.request_timeout = request_timeout
    app.state.serving = serving
    app.state.lifecycle = lifecycle = Lifecycle()

    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(_APIKeyCheck, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_request: Request, e: OpenAIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, e: RequestValidationError):
        message, param = describe_validation_errors(e.errors())
        return _error(OpenAIError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        return _http_error(request.scope, e)

    @app.exception_handler(ValueError)
    async def on_value_error(_request: Request, e: ValueError):
        return _error(bad_value(e))

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, e: Exception):
        """A bug, not the client's fault: a 500 that says no more; the traceback goes to the log
        (Starlette re-raises the exception after this response, and uvicorn logs it)."""
        logger.error("internal error on %s %s: %s", request.method, request.url.path, type(e).__name__)
        return _error(OpenAIError("internal error", status=500, type_="server_error", code="internal_error"))

    @app.get("/health")
    async def health():
        """200 while requests are served; 503 with the reason while draining, restarting or dead."""
        if lifecycle.draining:
            return _error(_shutting_down())
        if engine.healthy:
            return Response(status_code=200)
        if engine.restarting:
            message, code = "the engine process died and is restarting", "engine_restarting"
        else:
            message, code = f"engine is not running: {engine.dead_error}", "engine_dead"
        return _error(OpenAIError(message, status=503, type_="server_error", code=code))

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now(), "owned_by": "pagoda", "root": model_root or name,
             "parent": None, "max_model_len": serving.max_model_len}
            for name in served_model_names]}

    def _check_alive():
        if lifecycle.draining:
            raise _shutting_down()
        if not engine.healthy:
            state = "restarting" if engine.restarting else f"not running: {engine.dead_error}"
            raise OpenAIError(f"engine is {state}", status=503, type_="server_error", code="engine_dead")

    async def respond(handler, body, request: Request):
        """Run a completion-style handler: an SSE stream when asked for, else one JSON body.

        A streaming response notices a client that went away when a write fails or Starlette's
        disconnect listener fires, and its generator is closed, which aborts the request. A
        plain response writes nothing until the end, so it watches the connection itself."""
        _check_alive()
        if body.stream:
            return StreamingResponse(await handler(body), media_type="text/event-stream")
        result = await _unless_disconnected(request, handler(body))
        return FastJSONResponse(result) if result is not _GONE else Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(serving.completion, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(serving.chat, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if body.messages is not None:
            ids = serving.encode_chat(serving.chat_messages(body.messages), body.add_generation_prompt)
        elif body.prompt is not None:
            serving.check_prompt_chars(len(body.prompt))
            ids = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise OpenAIError("give `prompt` or `messages`", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        vocab = engine.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app


def _bind(host: str, port: int) -> socket.socket:
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


class _Server(uvicorn.Server):
    """uvicorn, with pagoda's stop rules: the first SIGTERM / SIGINT stops accepting (the listener
    closes; requests on open connections get 503) and lets requests in flight finish for up to
    `shutdown_timeout` seconds, then aborts the rest (streams end with an error event); a second
    signal aborts everything at once. The process then exits 0, not by re-raising the signal."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, engine: AsyncLLM, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.app_state, self.engine, self.shutdown_timeout = app.state, engine, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

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


def run_server(args) -> int:
    """Load the model, start the engine, serve until a stop signal; returns the exit status."""
    from pagoda.engine.llm_engine import LLMEngine

    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ValueError("tensor_parallel_size > 1 is not supported yet (tensor parallelism is a later issue)")
    from pagoda.entrypoints.cli import _engine_args

    sock = _bind(args.host, args.port)
    engine = LLMEngine(_engine_args(args).create_engine_config(), build_core=not args.engine_process)
    names = args.served_model_name or [args.model]
    api_key = args.api_key or os.environ.get("PAGODA_API_KEY")
    async_engine = AsyncLLM(engine, engine_process=args.engine_process, max_engine_restarts=args.max_engine_restarts)
    app = build_app(async_engine, names, api_key=api_key, max_queue_len=args.max_queue_len, model_root=args.model,
                    request_timeout=args.request_timeout)
    cfg = engine.config.model
    print(f"pagoda {__version__}: loaded {args.model} ({cfg.architecture}, {str(cfg.dtype).removeprefix('torch.')}, "
          f"{cfg.device.type}, max_model_len={engine.max_model_len}, KV blocks={async_engine.limits.num_blocks}, "
          f"engine in a {'process' if args.engine_process else 'thread'}) "
          f"as {', '.join(names)}", flush=True)
    print(f"pagoda: serving on http://{args.host}:{args.port}/v1", flush=True)
    # What is built by now (model, tokenizer, app: ~330k objects) lives until exit. Frozen, the
    # cyclic GC's full collections skip it; they walked it all, a ~0.3 s pause of the event loop
    # every few thousand tokens (benchmarks/README.md, "Server cost per token").
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                            # uvicorn's own deadline, a backstop behind the drain in _Server
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = _Server(config, app, async_engine, args.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        async_engine.shutdown()
        sock.close()
        # Frozen objects escape the interpreter's last collection, so the nanobind extension
        # among them (triton's libtriton, loaded by torch._dynamo) printed ~27 lines of
        # "nanobind: leaked ..." on every exit. Unfrozen, they are collected like any others.
        gc.unfreeze()
    print("pagoda: stopped", flush=True)
    return 0
