"""The server's HTTP plumbing below the routes: JSON responses in OpenAI's error shape, and the
plain ASGI middlewares (API key, body size). Plain ASGI rather than Starlette's
`@app.middleware("http")` (BaseHTTPMiddleware), which relays every streamed chunk through a
memory stream and a task of its own: that added ~70 % to the event loop's time per streamed
token (benchmarks/README.md, "Server cost per token")."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.entrypoints.input_limits import NESTED_TOO_DEEPLY
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.response_parts import dumps

OPEN_PATHS = {"/health", "/version", "/metrics", "/docs", "/openapi.json",
              "/", "/dashboard"}  # the web pages (pagoda/entrypoints/web): they ask for the key themselves
OPEN_PREFIXES = ("/web/", "/docs/")  # the web pages' static files, /docs' Swagger UI


def is_open(path: str) -> bool:
    """Whether a path is served without an API key."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)

# The largest request body taken: far above any prompt a context holds (a 128k-token prompt as
# token ids is ~1 MB of JSON), low enough that parsing and refusing one costs about a second
# (16 MB of token ids: 0.6 s here, tests/entrypoints/test_errors.py).
MAX_BODY_BYTES = 32 * 1024 * 1024
# Routes with a limit of their own: a blob upload (a model's GGUF) is held to --max-blob-size
# (pagoda/entrypoints/ollama/store_routes.py) as it streams to a file, never to memory.
OWN_BODY_LIMIT_PREFIXES = ("/api/blobs/",)


class FastJSONResponse(JSONResponse):
    """JSON bodies written by orjson (serving.dumps): 6-7x faster than json.dumps on our bodies."""

    def render(self, content) -> bytes:
        return dumps(content)


def error_response(e: OpenAIError) -> JSONResponse:
    return FastJSONResponse(e.body(), status_code=e.status, headers=e.headers)


class ReleasingStream(StreamingResponse):
    """A stream that runs `on_end` once it is over, however it ends (done, client gone, error):
    a streamed answer gives back its share of the engine-level limit (`Admission.release`)."""

    def __init__(self, content, on_end, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


class APIKeyCheck:
    """401 for a request without `Authorization: Bearer <key>`, except on the open paths; installed
    only when a key is set."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not is_open(scope["path"]):
            headers = Headers(scope=scope)
            given = headers.get("authorization") or (f"Bearer {headers['x-api-key']}" if "x-api-key" in headers else "")
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError("invalid or missing API key", status=401, type_="authentication_error",
                                    code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when the streamed body passes the limit. An HTTPException, so that
    FastAPI's body reading lets it through to the handler (any other error there becomes a 400)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(status_code=413, detail=f"the request body is larger than the server's limit of "
                                                 f"{max_bytes} bytes")


class BodyLimit:
    """413 for a request body over `max_bytes`: before reading it when Content-Length says so, else
    as soon as the bytes received (a chunked body) pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OWN_BODY_LIMIT_PREFIXES):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await http_error(scope, _BodyTooLarge(self.max_bytes))(scope, receive, send)
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
            await http_error(scope, e)(scope, receive, send)


def http_error(scope: Scope, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's HTTP errors (no such route, wrong method, unreadable or oversized body) as
    OpenAI-style bodies instead of `{"detail": ...}`."""
    method, path = scope.get("method", ""), scope.get("path", "")
    message = {404: f"Invalid URL ({method} {path})",
               405: f"Method {method} not allowed on {path}"}.get(e.status_code, str(e.detail))
    if e.status_code == 400 and message == "There was an error parsing the body":
        message = _unparsable_body(e.__cause__)
    server_side = e.status_code >= 500
    code = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",  # 408: security/timeouts.py
            413: "request_too_large"}.get(e.status_code)
    return error_response(OpenAIError(message, status=e.status_code, type_="server_error" if server_side else
                              "invalid_request_error", code=code, headers=dict(e.headers or {})))


def _unparsable_body(cause: BaseException | None) -> str:
    """Why FastAPI could not read the body as JSON (it says only that it could not)."""
    if isinstance(cause, RecursionError):
        return NESTED_TOO_DEEPLY
    if isinstance(cause, UnicodeDecodeError):
        return "the body is not valid JSON: it is not UTF-8 text"
    return "the body is not valid JSON"
