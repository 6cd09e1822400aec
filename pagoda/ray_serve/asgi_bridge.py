"""pagoda's FastAPI app driven in process by plain data: the engine replica's side of the hop from
the ingress.

Why not Ray Serve's own ASGI ingress on the engine replica: the request router runs where the
*handle* call is made, and it sees the call's arguments, not an HTTP body. So the ingress reads
the body, works out the route (session key, prompt text) and calls the replica with the request
as data (`HTTPCall`); the replica plays it into its app here and streams the ASGI messages back
(`Head`, then the body's bytes). Every route of `pagoda serve` works unchanged: this is the
same app, only its transport differs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class HTTPCall:
    """One HTTP request as data (picklable), as the ingress received it."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass(frozen=True)
class Head:
    """The response's status and headers: the first item a replica streams back."""

    status: int
    headers: list[tuple[bytes, bytes]]


def http_scope(call: HTTPCall) -> Message:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
        "root_path": "", "query_string": call.query_string, "headers": list(call.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {},
    }


async def play(app: Any, call: HTTPCall, extra_headers: list[tuple[bytes, bytes]] = ()) -> AsyncIterator[Head | bytes]:
    """Run `call` through the ASGI `app`: yields its `Head`, then each non-empty body chunk.

    Closing the generator early (the ingress's client went away) tells the app the client
    disconnected, which aborts the engine request, and waits for the app to finish."""
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()  # after the body, the only message left is the disconnect
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(http_scope(call), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait({"type": "pagoda.app_done"}))
    try:
        while True:
            message = await sent.get()
            kind = message["type"]
            if kind == "http.response.start":
                yield Head(message["status"], list(message.get("headers", [])) + list(extra_headers))
            elif kind == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
            elif kind == "pagoda.app_done":
                task.result()  # the app raised: raise it here
                return
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=10.0)
            task.cancel()


class Lifespan:
    """The app's ASGI lifespan (its startup and shutdown handlers: sessions, stored responses,
    the batch runner), run as uvicorn would run it."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _expect(self, wanted: str) -> None:
        message = await self._outbox.get()
        if message["type"] != wanted:
            raise RuntimeError(f"the app's lifespan answered {message['type']}: {message.get('message', '')}")

    async def startup(self) -> None:
        self._task = asyncio.ensure_future(self._app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                     self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        await self._expect("lifespan.startup.complete")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._expect("lifespan.shutdown.complete")
        await self._task
