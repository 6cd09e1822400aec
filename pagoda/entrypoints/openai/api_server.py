"""`pagoda serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM."""

from __future__ import annotations

import gc
import logging
import os
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda import __version__
from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, now,
)
from pagoda.entrypoints.openai.serving import OpenAIError, Serving, bad_value, dumps

logger = logging.getLogger("pagoda.server")

_OPEN_PATHS = {"/health", "/version", "/metrics", "/docs", "/openapi.json"}


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


def build_app(engine: AsyncLLM, served_model_names: list[str], *, api_key: str | None = None,
              max_queue_len: int | None = None, model_root: str | None = None) -> FastAPI:
    app = FastAPI(title="pagoda", version=__version__, default_response_class=FastJSONResponse)
    serving = Serving(engine, served_model_names, max_queue_len)
    app.state.serving = serving

    if api_key:
        app.add_middleware(_APIKeyCheck, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_request: Request, e: OpenAIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        return _error(OpenAIError(f"{param}: {first.get('msg', 'invalid request')}" if param else str(e), param=param))

    @app.exception_handler(ValueError)
    async def on_value_error(_request: Request, e: ValueError):
        return _error(bad_value(e))

    @app.get("/health")
    async def health():
        if engine.healthy:
            return Response(status_code=200)
        return FastJSONResponse({"error": {"message": f"engine is not running: {engine.dead_error}",
                                           "type": "server_error", "param": None, "code": "engine_dead"}}, status_code=503)

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
        if not engine.healthy:
            raise OpenAIError(f"engine is not running: {engine.dead_error}", status=503, type_="server_error", code="engine_dead")

    async def respond(handler, body):
        """Run a completion-style handler: an SSE stream when asked for, else one JSON body."""
        _check_alive()
        result = await handler(body)
        if body.stream:
            return StreamingResponse(result, media_type="text/event-stream")
        return FastJSONResponse(result)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await respond(serving.completion, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await respond(serving.chat, body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        tok = serving.tokenizer
        if body.messages is not None:
            ids = tok.encode_chat([{"role": m.role, "content": m.content or ""} for m in body.messages],
                                  body.add_generation_prompt)
        elif body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
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


def run_server(args) -> int:
    """Load the model, start the engine thread, serve until interrupted."""
    import uvicorn

    from pagoda.engine.llm_engine import LLMEngine

    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ValueError("tensor_parallel_size > 1 is not supported yet (tensor parallelism is a later issue)")
    from pagoda.entrypoints.cli import _engine_args

    engine = LLMEngine(_engine_args(args).create_engine_config(), build_core=not args.engine_process)
    names = args.served_model_name or [args.model]
    api_key = args.api_key or os.environ.get("PAGODA_API_KEY")
    async_engine = AsyncLLM(engine, engine_process=args.engine_process)
    app = build_app(async_engine, names, api_key=api_key, max_queue_len=args.max_queue_len, model_root=args.model)
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
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        async_engine.shutdown()
    return 0
