"""Noticing a client that leaves while its request is being worked on (the server's engine
requests, the router's forwarding): light enough for the router to import without the engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from starlette.requests import Request

logger = logging.getLogger("pagoda.server")

GONE = object()  # unless_disconnected's answer when the client left first


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first; returns `GONE` then.
    Cancelling is what frees the work's resources: the server's engine requests are aborted (and
    their KV blocks freed), the router's connection to a replica closes (which aborts the
    generation there). The body has been read by now, so the next ASGI message can only be
    `http.disconnect`, sent when the connection is lost."""
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
        return GONE
    return task.result()
