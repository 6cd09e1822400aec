"""The ingress deployment: the OpenAI-compatible endpoint behind Ray Serve's HTTP proxy.

Every request is read here (its body too), given its route (session key, prompt text:
pagoda/router/affinity.py) and passed as data to an engine replica through a deployment handle,
whose request router (request_router.py) picks the replica by pagoda's policy. The answer streams
back chunk by chunk. Why a deployment of its own rather than `serve.ingress` on the engine
replicas: Serve's proxy routes by path only, and the routing here needs the body; and the engine
replicas scale without the endpoint moving.

Retries: a replica that dies (its actor is gone or unreachable) before the answer's first body
bytes came back has sent the client nothing, so the request is sent once more, to another
replica or to the one Serve starts in its place. The status and headers are held back until the
first body bytes for that reason (a non-streaming answer is one body, so it is retried up to the
end). Once bytes went out, a stream that breaks ends with an error event, as behind
`pagoda router`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import orjson
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pagoda.ray_serve.asgi_bridge import Head, HTTPCall
from pagoda.router.affinity import route_request

logger = logging.getLogger("pagoda.ray_serve")

REPLICA_GONE = (RayActorError, ActorUnavailableError)  # the replica actor died or cannot be reached
ATTEMPTS = 2  # the first try and one retry
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}  # set again by the proxy's server
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


class ReplicaFailed(Exception):
    """No replica answered within the attempts."""


async def http_call(request: Request) -> HTTPCall:
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() not in HOP_HEADERS]
    return HTTPCall(request.method, request.url.path, request.scope.get("query_string", b""), headers,
                    await request.body())


async def open_answer(engine: DeploymentHandle, call: HTTPCall, route) -> tuple[Head, list[bytes], AsyncIterator]:
    """The answer's head, its first body chunk (none if the body is empty) and the rest, from
    the first replica that lives until its first body bytes (`ATTEMPTS` in all)."""
    failure: BaseException | None = None
    for attempt in range(ATTEMPTS):
        stream: DeploymentResponseGenerator = engine.options(stream=True).forward.remote(route, call)
        try:
            head = await stream.__anext__()
            first = [await stream.__anext__()]
        except StopAsyncIteration:
            return head, [], stream
        except REPLICA_GONE as e:
            failure = e
            logger.warning("an engine replica failed before answering %s %s (attempt %d of %d): %s",
                           call.method, call.path, attempt + 1, ATTEMPTS, e)
            continue
        return head, first, stream
    raise ReplicaFailed(str(failure))


async def relay(first: list[bytes], stream: AsyncIterator) -> AsyncIterator[bytes]:
    """The body: the chunk already read, then the rest; a replica lost midway ends an event
    stream with an error event (the client has its head already)."""
    for chunk in first:
        yield chunk
    try:
        async for chunk in stream:
            yield chunk
    except REPLICA_GONE as e:
        logger.error("an engine replica failed while streaming: %s", e)
        error = {"error": {"message": f"the engine replica failed: {e}", "type": "server_error",
                           "code": "worker_failed"}}
        yield b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"


def build_ingress_app(engine_of: callable) -> Starlette:
    """The Starlette app of the ingress; `engine_of()` is the engine deployment's handle."""

    async def forward(request: Request) -> Response:
        call = await http_call(request)
        try:
            body = orjson.loads(call.body) if call.body else None
        except orjson.JSONDecodeError:
            body = None  # the replica's app answers the 400
        try:
            head, first, stream = await open_answer(engine_of(), call, route_request(request.headers, body))
        except ReplicaFailed as e:
            return JSONResponse({"error": {"message": f"no engine replica answered: {e}", "type": "server_error",
                                           "code": "worker_failed"}}, status_code=503)
        response = StreamingResponse(relay(first, stream), status_code=head.status)
        response.raw_headers = [(k, v) for k, v in head.headers if k.lower() not in HOP_HEADERS]
        return response

    return Starlette(routes=[Route("/{path:path}", forward, methods=METHODS)])
