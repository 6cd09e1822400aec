"""The front of a server of several models: one app that answers what concerns them all
(`/v1/models`, `/api/tags`, `/api/ps`, `/metrics`, `/health`, the model store's routes) and
hands every request that names a model to that model's own app (api_server.build_app), loaded
by the pool (model_pool.py) when needed.

The hand-over is plain ASGI (`ModelDispatch`): the body is read once, its `model` field picks
the model, and the model's app gets the same scope with the body replayed, so every route
behaves exactly as on a server of one model (limits, streaming, errors, disconnects). The
request counts as in flight on its model until the model's app has sent the whole answer,
a stream's last chunk included; only then may the model be unloaded. With `--auth-config` the
key's role is checked here, before the pool is asked for the model: a request for a model the
role may not use (a `keep_alive: 0` unload included) is the same 403 a server of one model
gives, and loads, evicts or unloads nothing.

Which requests go where:
- a JSON body's `model` (Ollama's `/api/show`: `model` or `name`): `/v1/completions`,
  `/v1/chat/completions`, `POST /v1/sessions`, `/tokenize`, `/detokenize`, `/api/generate`,
  `/api/chat`, `/api/show` (a name no model has goes to the store);
- `/v1/sessions/{id}...`: the loaded model that holds the session;
- `/v1/debug/...?model=NAME` (the dashboard's data): that model, else the one used last;
- anything else: the front.
"""

from __future__ import annotations

import time
from urllib.parse import parse_qs

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda import __version__
from pagoda.entrypoints import ollama
from pagoda.entrypoints.ollama import common as ollama_common, models as ollama_models
from pagoda.entrypoints.model_pool import ModelPool
from pagoda.entrypoints.openai.error_handlers import install_error_handlers
from pagoda.entrypoints.openai.lifecycle import Lifecycle, shutting_down
from pagoda.entrypoints.openai.middleware import (
    MAX_BODY_BYTES, APIKeyCheck, BodyLimit, FastJSONResponse, error_response,
)
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.served_models import FOREVER, ModelSpec, parse_keep_alive
from pagoda.entrypoints.web.api_docs import install_api_docs
from pagoda.entrypoints.web.pages import install_pages
from pagoda.security.context import request_context

OPENAI_MODEL_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/sessions", "/tokenize",
                                "/detokenize"})
OLLAMA_MODEL_PATHS = frozenset({"/api/generate", "/api/chat", "/api/show"})
SESSION_PATH = "/v1/sessions/"
DEBUG_PATH = "/v1/debug/"


class ModelDispatch:
    """ASGI middleware of the front app: requests that name a model run on that model's app."""

    def __init__(self, app: ASGIApp, pool: ModelPool, lifecycle: Lifecycle) -> None:
        self.app, self.pool, self.lifecycle = app, pool, lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] not in ("POST", "GET", "DELETE"):
            await self.app(scope, receive, send)
        elif path in OPENAI_MODEL_PATHS or path in OLLAMA_MODEL_PATHS:
            await self._by_body(scope, receive, send, ollama=path.startswith("/api/"))
        elif path.startswith(SESSION_PATH):
            await self._by_session(scope, receive, send)
        elif path.startswith(DEBUG_PATH):
            await self._by_query(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _by_body(self, scope: Scope, receive: Receive, send: Send, ollama: bool) -> None:
        body = await _read_body(receive)
        replay = _replaying(body, receive)
        path = scope["path"]
        fields = _json_object(body)
        if fields is None and path != "/api/show":  # names no model (/api/show's: the store's route answers it)
            await _error(OpenAIError("the request body must be a JSON object"), ollama)(scope, replay, send)
            return
        fields = fields or {}
        name = fields.get("model") or (fields.get("name") if path == "/api/show" else None)
        spec = self.pool.find(name) if isinstance(name, str) else None
        try:
            if spec is None:
                if path == "/api/show":  # a model of the store, not a served one: the front's route
                    await self.app(scope, replay, send)
                    return
                raise self._unknown(name, ollama)
            _check_role(spec, name)  # before the pool loads, evicts or unloads anything
            keep_alive = _keep_alive(fields)
            if ollama and keep_alive == 0 and _is_load_request(path, fields):  # Ollama's "unload this model"
                await self.pool.unload_now(spec)
                await _ollama_unloaded(path, fields["model"])(scope, replay, send)
                return
            if spec.name not in self.pool.loaded:
                _check_limits()
            await self._run(spec, scope, replay, send, keep_alive)
        except OpenAIError as e:
            await _error(e, ollama)(scope, replay, send)

    async def _by_session(self, scope: Scope, receive: Receive, send: Send) -> None:
        session_id = scope["path"][len(SESSION_PATH):].split("/", 1)[0]
        model = self.pool.loaded_holding(lambda m: m.app.state.sessions.holds(session_id))
        if model is None:
            error = OpenAIError(f"no session `{session_id}` (it ended, expired, or its model was unloaded)",
                                status=404, param="session_id", code="session_not_found")
            await error_response(error)(scope, receive, send)
            return
        try:
            await self._run(model.spec, scope, receive, send, "default")
        except OpenAIError as e:
            await error_response(e)(scope, receive, send)

    async def _by_query(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`/v1/debug/...?model=NAME`: that model's engine; without a name, the model loaded last
        (else the first one, loaded for it)."""
        name = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[0]
        spec = self.pool.find(name) if name else None
        try:
            if spec is None and name:
                raise self._unknown(name, ollama=False)
            if spec is None:
                loaded = sorted(self.pool.loaded.values(), key=lambda m: m.last_used)
                spec = loaded[-1].spec if loaded else self.pool.specs[0]
            await self._run(spec, scope, receive, send, "default")
        except OpenAIError as e:
            await error_response(e)(scope, receive, send)

    async def _run(self, spec: ModelSpec, scope: Scope, receive: Receive, send: Send, keep_alive) -> None:
        if self.lifecycle.draining:
            raise shutting_down()
        try:
            model = await self.pool.acquire(spec, keep_alive)
        except ValueError as e:  # the loader's word on a bad model file (a tensor's shape, ...)
            raise OpenAIError(f"the model `{spec.name}` could not be loaded: {e}", status=500, type_="server_error",
                              code="model_load_failed") from None
        try:
            await model.app(scope, receive, send)
        finally:
            self.pool.release(model)

    def _unknown(self, name, ollama: bool) -> OpenAIError:
        ctx = request_context()  # --auth-config: the 404 lists only the names the key's role may use
        names = ctx.visible(self.pool.names) if ctx is not None else self.pool.names
        listed = ", ".join(f"`{n}`" for n in names)
        if not name:
            return OpenAIError(f"`model` is required: this server serves {listed}", param="model")
        return OpenAIError(f"The model `{name}` does not exist. This server serves {listed}.", status=404,
                           type_="NotFoundError", param="model", code="model_not_found")


def _check_role(spec: ModelSpec, name: str) -> None:
    """--auth-config: 403 `model_not_allowed` unless the key's role may use the model by the name
    the request gave (`:latest` dropped where only that matches), as a server of one model
    answers; checked in the front, so a refused request never loads, evicts or unloads a model."""
    ctx = request_context()
    if ctx is not None:
        ctx.check_model(name if spec.accepts(name) else name.removesuffix(":latest"))


def _check_limits() -> None:
    """--auth-config: the 429 the tenant's limits (requests at once, tokens per minute) would get
    from the model's app, asked before the pool loads the model for it (a load for a refused
    request would evict another model for nothing)."""
    ctx = request_context()
    if ctx is not None:
        ctx.check_admissible()


def _is_load_request(path: str, fields: dict) -> bool:
    """Ollama's load / unload requests: /api/generate without a prompt, /api/chat without messages."""
    if path == "/api/generate":
        return not fields.get("prompt") and not fields.get("context")
    return path == "/api/chat" and not fields.get("messages")


def _ollama_unloaded(path: str, model: str) -> Response:
    reply = {"model": model, "created_at": ollama_common.now_iso(), "done": True, "done_reason": "unload"}
    if path == "/api/chat":
        reply["message"] = {"role": "assistant", "content": ""}
    else:
        reply["response"] = ""
    return ollama_common.json_response(reply)


def _error(e: OpenAIError, ollama: bool) -> Response:
    if not ollama:
        return error_response(e)
    response = ollama_common.ollama_error_response(e.message, e.status)
    response.headers.update(e.headers)
    return response


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body read already, then what the client sends next (a
    disconnect, which the model's app listens for)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _json_object(body: bytes) -> dict | None:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


# -- the front app ---------------------------------------------------------------------------------
def build_front_app(pool: ModelPool, metric_families, *, api_key: str | None = None,
                    max_body_bytes: int = MAX_BODY_BYTES, web_ui: bool = True) -> FastAPI:
    """The app `pagoda serve` runs with several models (module docstring)."""
    app = FastAPI(title="pagoda", version=__version__, default_response_class=FastJSONResponse, docs_url=None)
    install_api_docs(app)  # the vendored Swagger UI: /docs works offline
    app.state.pool = pool
    app.state.lifecycle = lifecycle = Lifecycle()
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        """200 while requests are served; 503 while draining or when a loaded model's engine died."""
        if lifecycle.draining:
            return error_response(shutting_down())
        for model in pool.loaded.values():
            if not model.engine.healthy and not model.engine.restarting:
                return error_response(OpenAIError(f"the engine of `{model.spec.name}` is not running: "
                                                  f"{model.engine.dead_error}", status=503, type_="server_error",
                                                  code="engine_dead"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(metric_families.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        ctx = request_context()
        rows = []
        for spec in pool.specs:
            loaded = pool.loaded.get(spec.name)
            context = loaded.serving.max_model_len if loaded is not None else spec.config.model.max_model_len
            for name in ctx.visible(spec.names) if ctx is not None else spec.names:
                rows.append({"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagoda",
                             "root": spec.args.model, "parent": None, "max_model_len": context,
                             "loaded": loaded is not None})
        return {"object": "list", "data": rows}

    @app.get("/api/tags")
    @ollama_common.ollama_errors
    async def tags():
        ctx = request_context()
        served = [(name, _description(spec)) for spec in pool.specs
                  for name in (ctx.visible(spec.names) if ctx is not None else spec.names)]
        return await ollama_models.tags_response(served)

    @app.get("/api/ps")
    @ollama_common.ollama_errors
    async def ps():
        ctx = request_context()
        rows = []
        for model in list(pool.loaded.values()):
            spec = model.spec
            expires = _expires_at(model)
            on_gpu = spec.config.model.device.type == "cuda"
            for name in ctx.visible(spec.names) if ctx is not None else spec.names:
                rows.append(ollama_models.ps_row(name, _description(spec), model.serving.max_model_len, on_gpu,
                                              expires, size=model.footprint))
        return ollama_common.json_response({"models": rows})

    app.include_router(ollama.router)  # /api/version and the store's routes (pull, push, copy, ...)
    if web_ui:  # the playground and the dashboard (pagoda/entrypoints/web); their data comes per model
        install_pages(app)
    app.add_middleware(ModelDispatch, pool=pool, lifecycle=lifecycle)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    app.router.on_startup.append(pool.preload)
    app.router.on_shutdown.append(pool.close)
    return app


def _keep_alive(fields: dict):
    """The request's `keep_alive` in seconds ("default" when absent); a bad one is a 400 naming it."""
    if fields.get("keep_alive") is None:
        return "default"
    try:
        return parse_keep_alive(fields["keep_alive"])
    except ValueError as e:
        raise OpenAIError(str(e), param="keep_alive") from None


def _expires_at(model) -> str:
    """/api/ps' expires_at: when the model unloads if no request comes (a busy model: its
    keep_alive from now)."""
    if model.keep_alive is FOREVER:
        return ollama_common.NEVER
    return ollama_common.iso_time(model.expires_at if model.expires_at is not None else time.time() + model.keep_alive)


def _description(spec: ModelSpec) -> dict:
    """Ollama's description of a served model, loaded or not (model_description, cached)."""
    if spec.description is None:
        spec.description = ollama_models.model_description(spec.config.model, spec.config.model.max_model_len)
    return spec.description
