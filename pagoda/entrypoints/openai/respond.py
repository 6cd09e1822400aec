"""One generation request's answer under the server's admission: an SSE stream when asked for,
else one JSON body, with the request's share of `--max-num-seqs` + `--max-queue-len` held until
the answer is done. Shared by the OpenAI routes and Anthropic's `/v1/messages`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagoda.entrypoints.disconnect import GONE, unless_disconnected
from pagoda.entrypoints.openai.admission import Admission
from pagoda.entrypoints.openai.lifecycle import Lifecycle, check_serving
from pagoda.entrypoints.openai.middleware import FastJSONResponse, ReleasingStream
from pagoda.entrypoints.openai.serving import Serving

Handler = Callable[[Any, Admission], Awaitable[Any]]  # (body, admission) → an SSE byte stream or a JSON dict


async def respond(serving: Serving, lifecycle: Lifecycle, handler: Handler, body: Any, request: Request) -> Response:
    """Run a completion-style handler: an SSE stream when `body.stream`, else one JSON body.

    A streaming response notices a client that went away when a write fails or Starlette's
    disconnect listener fires, and its generator is closed, which aborts the request. A
    plain response writes nothing until the end, so it watches the connection itself."""
    check_serving(lifecycle, serving.engine)
    serving.check_runner("generate")  # an embedding model (--runner pooling) generates nothing: 400
    admission = serving.admission()  # its part of --max-num-seqs + --max-queue-len, held to the end
    try:
        if body.stream:
            response = ReleasingStream(await handler(body, admission), admission.release,
                                        media_type="text/event-stream")
            admission = None  # the stream gives it back when it ends
            return response
        result = await unless_disconnected(request, handler(body, admission))
        return FastJSONResponse(result) if result is not GONE else Response(status_code=499)
    finally:
        if admission is not None:
            admission.release()
