"""`/v1/debug/...`: the engine recorder's snapshots as JSON, and as a server-sent event stream.

Every answer names the served model (`model`); a `?model=NAME` query is accepted and left to the
front of a several-model server, which routes by it. With `--api-key` the key is needed, with
`--auth-config` a key whose role has `admin: true` (security/access.py). The shapes are
documented in docs/architecture.md ("The web playground and the engine dashboard").
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from pagoda.engine.async_llm import EngineUnavailableError
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.response_parts import sse
from pagoda.entrypoints.openai.serving import Serving

router = APIRouter()

# How often the stream may ask the engine: a snapshot younger than this is shared by every
# stream (several dashboards cost the engine what one does).
MIN_SNAPSHOT_INTERVAL = 0.1


class DebugFeed:
    """Asks the engine for snapshots and turns token ids into text for the radix view."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self._lock = asyncio.Lock()
        self._last: tuple[float, dict] | None = None

    @property
    def model(self) -> str:
        return self.serving.model_names[0]

    async def view(self, what: str, limit: int | None = None) -> dict:
        """One snapshot (`engine`, `steps`, `requests`, `radix`), with the model's name."""
        snapshot = await self._ask(what, limit)
        if what == "radix":
            self._add_previews(snapshot)
        return {"object": f"debug.{what}", "model": self.model, **snapshot}

    async def latest(self) -> dict:
        """Everything the dashboard shows, at most every MIN_SNAPSHOT_INTERVAL seconds."""
        async with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= MIN_SNAPSHOT_INTERVAL:
                snapshot = await self._ask("all")
                self._add_previews(snapshot["radix"])
                self._last = (now, {"object": "debug.all", "model": self.model, **snapshot})
            return self._last[1]

    async def _ask(self, what: str, limit: int | None = None) -> dict:
        try:
            return await self.serving.engine.debug(what, limit)
        except (EngineUnavailableError, asyncio.TimeoutError) as e:
            raise OpenAIError(f"the engine did not answer: {e or 'timed out'}", status=503, type_="server_error",
                              code="engine_unavailable") from e

    def _add_previews(self, radix: dict) -> None:
        """Each node's first tokens as text (`preview`)."""
        decode = self.serving.tokenizer.decode
        for node in radix.get("nodes", ()):
            node["preview"] = decode(node["token_ids"], skip_special_tokens=False) if node["token_ids"] else ""


def _feed(request: Request) -> DebugFeed:
    return request.app.state.debug_feed


ModelQuery = Query(None, description="the served model (a several-model server routes by it)")


@router.get("/v1/debug/engine")
async def debug_engine(request: Request, model: str | None = ModelQuery):
    """Counters and gauges, the last 10 s summed up (throughput, TTFT / ITL percentiles), and
    one point per second over the last minute."""
    return await _feed(request).view("engine")


@router.get("/v1/debug/steps")
async def debug_steps(request: Request, limit: int = Query(256, ge=1, le=256), model: str | None = ModelQuery):
    """The scheduler's last steps, newest first."""
    return await _feed(request).view("steps", limit)


@router.get("/v1/debug/requests")
async def debug_requests(request: Request, limit: int = Query(100, ge=1, le=100), model: str | None = ModelQuery):
    """Per-request timelines: waiting and running requests, then the last finished ones."""
    return await _feed(request).view("requests", limit)


@router.get("/v1/debug/radix")
async def debug_radix(request: Request, limit: int = Query(20, ge=1, le=200), model: str | None = ModelQuery):
    """The largest cached prefixes and the prefix tree of their paths."""
    return await _feed(request).view("radix", limit)


# Left out of /openapi.json: an endless event stream is no request / response operation (a schema
# fuzzer reading its whole body would wait forever); documented in docs/architecture.md.
@router.get("/v1/debug/stream", include_in_schema=False)
async def debug_stream(request: Request, interval: float = Query(0.25, ge=0.1, le=5.0),
                       model: str | None = ModelQuery):
    """Server-sent events: every `interval` seconds, one `data:` line with all four views
    (`engine`, `steps`, `requests`, `radix`). It ends when the client goes or the server stops."""
    feed, lifecycle = _feed(request), request.app.state.lifecycle
    first = await feed.latest()  # an engine that cannot answer is a 503 before the stream starts

    async def events():
        snapshot = first
        while True:
            yield sse(snapshot)
            await asyncio.sleep(interval)
            if lifecycle.draining:
                return
            try:
                snapshot = await feed.latest()
            except OpenAIError as e:
                yield sse(e.body())
                return

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
