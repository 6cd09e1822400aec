"""Slow clients (slowloris): `--read-timeout` seconds to send a request's headers, and again its body.

uvicorn times out only an idle keep-alive connection (`timeout_keep_alive`, after a response);
a connection that sends its request line and headers a byte at a time, or never finishes its
body, it holds for ever, so a few thousand such connections (no CPU, no bandwidth) take every
file descriptor. Two guards:

- `head_deadline_protocol`: uvicorn's HTTP protocol class with a deadline set when a connection
  opens, and again when the first byte of a next request arrives on a kept-alive one, cleared
  once the request's headers are complete. Past it the connection is closed (no request has
  reached the app, so nothing is answered).
- `BodyDeadline`: ASGI middleware giving the body the same time from the moment the app first
  reads it; past it, 408 `request_timeout` with `Connection: close`. Reads after the body
  (disconnect watching) are not timed.

Neither arms a timer per request: a deadline is a dict entry, and one timer per server checks
them every `min(1 s, timeout / 4)` while any is pending (a timer and its cancellation per
request cost ~10x more than the entry). A deadline so fires up to that much late.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class Deadlines:
    """Pending deadlines (key → (loop time, callback)), checked by one periodic timer that runs
    only while any is pending."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.period = max(0.05, min(1.0, timeout / 4))
        self.pending: dict[object, tuple[float, Callable[[], None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def add(self, key: object, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[], None]) -> None:
        self.pending[key] = (loop.time() + self.timeout, on_expiry)
        if self._timer is None:
            self._loop = loop
            self._timer = loop.call_later(self.period, self._check)

    def discard(self, key: object) -> None:
        self.pending.pop(key, None)

    def _check(self) -> None:
        self._timer = None
        now = self._loop.time()
        expired = [key for key, (deadline, _) in self.pending.items() if deadline <= now]
        for key in expired:
            _, on_expiry = self.pending.pop(key)
            on_expiry()
        if self.pending:
            self._timer = self._loop.call_later(self.period, self._check)


def head_deadline_protocol(timeout: float):
    """uvicorn's HTTP protocol class (the one `http="auto"` picks) with a deadline on request heads."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # deferred: uvicorn loads on first use

    deadlines = Deadlines(timeout)

    class HeadDeadlineProtocol(AutoHTTPProtocol):
        _head_pending = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_head()

        def data_received(self, data: bytes) -> None:
            if not self._head_pending and self._between_requests():
                self._start_head()  # the first byte of a next request on a kept-alive connection
            super().data_received(data)
            if self._head_pending and not self._between_requests():
                self._head_pending = False  # the headers are complete: the app has the request
                deadlines.discard(self)

        def connection_lost(self, exc) -> None:
            if self._head_pending:
                self._head_pending = False
                deadlines.discard(self)
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_head(self) -> None:
            self._head_pending = True
            deadlines.add(self, self.loop, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_pending = False
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadlineProtocol


class _BodyTimedOut(StarletteHTTPException):
    """Raised from `receive`; an HTTPException, so FastAPI's body reading lets it through to the
    app's handler (as middleware._BodyTooLarge does)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(status_code=408, detail=f"the request body did not arrive within the server's read "
                                                 f"timeout ({timeout:g} s)", headers={"Connection": "close"})


class _Body:
    """One request's body read (a deadline's key)."""

    __slots__ = ("done", "expired", "reading", "started", "task")

    def __init__(self) -> None:
        self.started = self.done = self.expired = self.reading = False
        self.task: asyncio.Task | None = None

    def expire(self) -> None:
        self.expired = True
        if self.reading:  # waiting in receive: interrupt it (else the next read raises)
            self.task.cancel()


class BodyDeadline:
    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app, self.timeout = app, timeout
        self.deadlines = Deadlines(timeout)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadlines = self.deadlines
        body = _Body()

        async def timed_receive() -> Message:
            if body.done:
                return await receive()
            if body.expired:
                raise _BodyTimedOut(self.timeout)
            if not body.started:  # the clock runs from the first read of the body
                body.started, body.task = True, asyncio.current_task()
                deadlines.add(body, asyncio.get_running_loop(), body.expire)
            body.reading = True
            try:
                message = await receive()
            except asyncio.CancelledError:
                if body.expired and body.task.uncancel() == 0:
                    raise _BodyTimedOut(self.timeout) from None
                raise
            finally:
                body.reading = False
            if message["type"] != "http.request" or not message.get("more_body", False):
                body.done = True
                deadlines.discard(body)
            return message

        try:
            await self.app(scope, timed_receive, send)
        except _BodyTimedOut as e:  # read outside a route (inside one, the app's handler answers it)
            # deferred: loads fastapi, llguidance, numpy, orjson, pydantic, ray, tokenizers, torch
            from pagoda.entrypoints.openai.middleware import http_error

            try:
                await http_error(scope, e)(scope, receive, send)
            except RuntimeError:  # the response had started: nothing more to say
                raise e from None
        finally:
            deadlines.discard(body)
