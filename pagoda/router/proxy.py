"""HTTP plumbing of the router: headers that cross (and do not), OpenAI-style error responses,
the relay of a worker's SSE stream to the client, and the watch on a client that leaves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("pagoda.router")

WORKER_HEADER = "x-pagoda-worker"  # added to every answer: the worker that gave it
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the two connections set for themselves.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
# The router's own server writes these on its answers; the worker's copies would repeat them.
ANSWER_SKIP = HOP_BY_HOP | {"date", "server"}
MAX_BODY_BYTES = 32 * 1024 * 1024  # as `pagoda serve`'s limit


class OpenAIErrorResponse(Response):
    """A JSON error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    media_type = "application/json"

    def __init__(self, message: str, status: int, type_: str, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(orjson.dumps(error_body(message, type_, code)), status_code=status, headers=headers)


def error_body(message: str, type_: str, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def forward_headers(headers: Headers) -> dict[str, str]:
    """The client's headers for the worker (Authorization included), less the hop-by-hop ones.
    A repeated header is joined with commas, as HTTP allows."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        if name not in HOP_BY_HOP:
            out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def answer_headers(upstream: httpx.Response, worker_url: str) -> dict[str, str]:
    """The worker's headers for the client, and which worker answered."""
    out = {name: value for name, value in upstream.headers.items() if name.lower() not in ANSWER_SKIP}
    out[WORKER_HEADER] = worker_url
    return out


def is_event_stream(upstream: httpx.Response) -> bool:
    return upstream.headers.get("content-type", "").startswith("text/event-stream")


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body, refusing one over `max_bytes` as soon as that is known."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge
        parts.append(chunk)
    return b"".join(parts)


def stream_error_event(message: str, *, mid_event: bool, code: str = "worker_failed") -> bytes:
    """What ends a stream the router cannot finish (its worker failed after bytes went out, or the
    router is shutting down): an SSE event with an OpenAI-style error (as `pagoda serve` ends a
    stream that fails), then `data: [DONE]`. A blank line first if the stream stopped in the
    middle of an event, so the error is an event of its own."""
    error = orjson.dumps(error_body(message, "server_error", code))
    return (b"\n\n" if mid_event else b"") + b"data: " + error + b"\n\ndata: [DONE]\n\n"


class RelayResponse(StreamingResponse):
    """A worker's SSE stream passed on chunk by chunk as it arrives (nothing is buffered).

    Starts with the chunk already read (the router waits for the first bytes before it commits to
    a worker, so a worker that fails before that can still be swapped for another). If the worker
    breaks the stream, the client gets `stream_error_event`; so it does if the router ends the
    stream (`end`, at shutdown). Whatever ends the response (the end of the stream, a client that
    left, a cancelled task) runs the close callbacks once: they close the worker's response and
    give back the in-flight counts."""

    def __init__(self, first: bytes, rest: AsyncIterator[bytes], *, status_code: int, headers: dict[str, str],
                 on_broken: Callable[[Exception], None]) -> None:
        super().__init__(self._relay(first, rest, on_broken), status_code=status_code, headers=headers)
        self._close_callbacks: list[Callable[[], Awaitable[None] | None]] = []
        self._closed = False
        self._ending: str | None = None  # why the router ends the stream (`end`)
        self._reader: asyncio.Task | None = None  # the task relaying, while it waits on the worker

    def on_close(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        self._close_callbacks.append(callback)

    def end(self, message: str) -> None:
        """End the stream now with a `shutting_down` error event and `data: [DONE]`. A relay waiting
        for the worker's next bytes is woken (its wait is cancelled); one sending to the client
        stops before its next wait."""
        if self._ending is None and not self._closed:
            self._ending = message
            if self._reader is not None:
                self._reader.cancel()

    async def _relay(self, first: bytes, rest: AsyncIterator[bytes],
                     on_broken: Callable[[Exception], None]) -> AsyncIterator[bytes]:
        last = first
        if first:
            yield first
        try:
            while self._ending is None:
                chunk = await self._next(rest)
                if chunk is None:
                    break
                if chunk:
                    last = chunk
                    yield chunk
        except httpx.HTTPError as e:
            on_broken(e)
            yield stream_error_event(f"the worker failed during the stream ({type(e).__name__}); "
                                     "the response is incomplete", mid_event=not last.endswith(b"\n\n"))
            return
        if self._ending is not None:
            yield stream_error_event(self._ending, mid_event=not last.endswith(b"\n\n"), code="shutting_down")

    async def _next(self, rest: AsyncIterator[bytes]) -> bytes | None:
        """The worker's next chunk; None at the end of its stream, or when `end` cut the wait."""
        task = asyncio.current_task()
        self._reader = task
        try:
            return await anext(rest, None)
        except asyncio.CancelledError:
            if self._ending is None or task is None:
                raise  # a real cancellation (the client left, the server gave up)
            task.uncancel()  # ours, from `end`: the stream goes on to its error event
            return None
        finally:
            self._reader = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.body_iterator.aclose()  # type: ignore[attr-defined]  (an async generator)
        for callback in self._close_callbacks:
            result = callback()
            if result is not None:
                await result


def models_of(answer: httpx.Response) -> list[dict]:
    """The model entries of a worker's /v1/models answer (none if it is not the expected JSON)."""
    try:
        data = answer.json().get("data", [])
    except (ValueError, AttributeError):
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


async def workers_models(client: httpx.AsyncClient, urls: list[str], headers: dict[str, str],
                         timeout: float) -> tuple[list[dict], list[int]]:
    """The union of the workers' /v1/models (by id, the first answer wins) and the statuses they
    answered (a worker that did not answer at all has none)."""
    answers = await asyncio.gather(*(client.get(f"{url}/v1/models", headers=headers, timeout=timeout) for url in urls),
                                   return_exceptions=True)
    seen: dict[str, dict] = {}
    statuses = []
    for answer in answers:
        if isinstance(answer, BaseException):
            continue
        statuses.append(answer.status_code)
        if answer.status_code == 200:
            for model in models_of(answer):
                seen.setdefault(model.get("id"), model)
    return list(seen.values()), statuses


async def read_raw(upstream: httpx.Response) -> bytes:
    """The worker's body as sent (not decoded: its Content-Encoding header goes on with it)."""
    return b"".join([chunk async for chunk in upstream.aiter_raw()])


def parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the worker will say what is wrong with it


def bearer_token(request: Request) -> str:
    """The API key a request carries ("" without one): the unit of the per-key rate limit."""
    auth = request.headers.get("authorization", "")
    return auth[7:] if auth[:7].lower() == "bearer " else auth
