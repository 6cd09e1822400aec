"""`pagoda serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagoda import __version__, envs
from pagoda.config import create_engine_config
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.content_filter import read_list
from pagoda.engine_args import EngineArgs
from pagoda.entrypoints.anthropic.messages import router as anthropic_router
from pagoda.entrypoints.model_dispatch import build_front_app
from pagoda.entrypoints.model_pool import ModelPool, PoolMetrics, footprint_bytes, format_gib
from pagoda.entrypoints.ollama import router as ollama_router
from pagoda.entrypoints.ollama.store_routes import BlobPolicy, install_blob_policy
from pagoda.entrypoints.served_models import default_memory_budget, model_specs, serves_several
from pagoda.entrypoints.web import install_web
from pagoda.entrypoints.web.api_docs import install_api_docs
from pagoda.entrypoints.openai.loading import loading_health
from pagoda.entrypoints.openai.lifecycle import DrainingServer, Lifecycle, bind_listener, check_serving, shutting_down
from pagoda.entrypoints.openai.middleware import (
    MAX_BODY_BYTES, APIKeyCheck, BodyLimit, FastJSONResponse, error_response,
)
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SessionCreateRequest, SessionMessageRequest,
    TokenizeRequest, now,
)
from pagoda.entrypoints.openai.error_handlers import install_error_handlers
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.pooling_routes import router as pooling_router
from pagoda.entrypoints.openai.lora_routes import router as lora_router, served_adapters
from pagoda.entrypoints.openai.respond import respond
from pagoda.entrypoints.openai.serving import Serving
from pagoda.entrypoints.openai.durable import DurableOptions, install_durable_state
from pagoda.entrypoints.state_db import default_state_dir
from pagoda.entrypoints.openai.reasoning import reasoning_format
from pagoda.entrypoints.openai.tool_formats import tool_call_format
from pagoda.executor.multiproc import run_headless
from pagoda.loader.catalog import catalog_aliases
from pagoda.security import tls
from pagoda.security.access import access_from_args, install as install_access
from pagoda.security.context import request_context
from pagoda.security.moderation import ServerModeration
from pagoda.security.timeouts import head_deadline_protocol
from pagoda.threads import openmp_settings

logger = logging.getLogger("pagoda.server")


def build_app(engine: AsyncLLM, served_model_names: list[str], *, api_key: str | None = None,
              max_queue_len: int | None = None, model_root: str | None = None,
              request_timeout: float | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              durable: DurableOptions | None = None,
              moderation_words: list[str] | None = None, moderation_action: str = "stop",
              metric_families=None, web_ui: bool = True, reasoning_parser: str | None = None,
              tool_call_parser: str | None = None, lora_modules: list[str] | None = None,
              ready_when: str = "loaded") -> FastAPI:
    """The app of one served model. Several models (pagoda serve --model A --model B) get one
    app each, behind the dispatcher of pagoda/entrypoints/model_dispatch.py, with one shared
    `metric_families` (pagoda/entrypoints/prometheus.py)."""
    app = FastAPI(title="pagoda", version=__version__, default_response_class=FastJSONResponse, docs_url=None)
    install_api_docs(app)  # the vendored Swagger UI: /docs works offline
    serving = Serving(engine, served_model_names, max_queue_len,
                      aliases=catalog_aliases(model_root, served_model_names), request_timeout=request_timeout,
                      metric_families=metric_families)
    app.state.serving = serving
    serving.reasoning = reasoning_format(reasoning_parser)
    serving.tool_format = tool_call_format(tool_call_parser)
    serving.adapters = served_adapters(engine, served_model_names[0], lora_modules)
    if not serving.tokenizer.chat_template and engine.runner == "generate":
        logger.warning("%s has no chat template (a base model): chat routes answer 400; use /v1/completions or "
                       "/api/generate, or give a template with --chat-template", served_model_names[0])

    serving.moderation = ServerModeration.from_args(moderation_words, moderation_action,
                                                    serving.metrics.content_filter_hit)
    app.state.lifecycle = lifecycle = Lifecycle()
    # sessions, stored responses, batch files and jobs, on the state database (durable.py)
    install_durable_state(app, serving, durable or DurableOptions())
    sessions = app.state.sessions

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)

    install_error_handlers(app)

    @app.get("/health")
    async def health():
        """200 while requests are served; 503 with the reason while draining, restarting or dead,
        and while the model loads layer by layer unless ``ready_when`` is "serving" (loading.py)."""
        if lifecycle.draining:
            return error_response(shutting_down())
        if engine.healthy:
            return loading_health(engine.loading_progress(), ready_when)
        if engine.restarting:
            message, code = "the engine process died and is restarting", "engine_restarting"
        else:
            message, code = f"engine is not running: {engine.dead_error}", "engine_dead"
        return error_response(OpenAIError(message, status=503, type_="server_error", code=code))

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        ctx = request_context()  # --auth-config: only the names the key's role may use
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now(), "owned_by": "pagoda", "root": model_root or name,
             "parent": None, "max_model_len": serving.max_model_len}
            for name in (ctx.visible(served_model_names) if ctx is not None else served_model_names)]
            + [card for card in (serving.adapters.model_cards(now(), serving.max_model_len) if serving.adapters else [])
               if ctx is None or ctx.visible([card["id"]])]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(serving, lifecycle, serving.completion, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(serving, lifecycle, serving.chat, body, request)

    # -- sessions: the history kept here, each turn computing only its new tokens (chat_sessions.py)
    @app.post("/v1/sessions")
    async def create_session(body: SessionCreateRequest, request: Request):
        check_serving(lifecycle, engine)
        session = sessions.create(body, request.headers.get("x-session-id"))
        return {"id": session.id, "object": "session", "model": session.model, "created": session.created}

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str):
        return sessions.get(session_id).describe(sessions.ttl)

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str):
        sessions.delete(session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/sessions/{session_id}/messages")
    async def session_message(session_id: str, body: SessionMessageRequest, request: Request):
        return await respond(serving, lifecycle, lambda b, admission: sessions.message(session_id, b, admission), body,
                             request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if body.messages is not None:
            ids = serving.encode_chat(serving.chat_messages(body.messages), body.add_generation_prompt)
        elif body.prompt is not None:
            serving.check_prompt_chars(len(body.prompt))
            ids = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
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

    app.include_router(ollama_router)  # Ollama's API, /api/... (pagoda/entrypoints/ollama)
    app.include_router(pooling_router)  # embeddings, score, rerank (pooling_routes.py: --runner pooling)
    app.include_router(lora_router)  # /v1/load_lora_adapter, /v1/unload_lora_adapter (lora_routes.py)
    app.include_router(anthropic_router)  # Anthropic's Messages API, /v1/messages (pagoda/entrypoints/anthropic)
    install_web(app, web_ui=web_ui)  # /, /dashboard and /v1/debug/... (pagoda/entrypoints/web)
    return app


def run_server(args) -> int:
    """Load the model, start the engine, serve until a stop signal; returns the exit status."""

    several = serves_several(args)
    engine_args = EngineArgs.from_cli_args(args)
    ssl_kwargs = tls.uvicorn_kwargs(args)  # --ssl-*: checked before loading anything
    for path in getattr(args, "moderation_words", None) or ():  # so are the word lists
        read_list(path)
    if engine_args.node_rank > 0:  # another node of a multi-node engine: its ranks only, no HTTP

        return run_headless(create_engine_config(engine_args))
    if several and args.grpc_port is not None:
        raise ValueError("--grpc-port serves one model: it cannot be combined with several models yet")

    # --auth-config / --audit-log (pagoda/security/access.py): a bad file fails before the model loads
    api_key = args.api_key or envs.PAGODA_API_KEY
    access = access_from_args(args, api_key)
    if access is not None:
        api_key = None  # the access middleware checks --api-key then (and gRPC through serving.access)
    blob_policy = BlobPolicy.from_args(args)  # /api/blobs' --max-blob-size, --blob-grace
    if several:
        specs, pool_settings = _several_models_settings(args)  # checked before the port is bound
    sock = bind_listener(args.host, args.port)
    if several:
        app, engines = _several_models_app(args, specs, pool_settings, api_key)
    else:
        app, engines = _one_model_app(args, engine_args, api_key)
    install_access(app, access, args.read_timeout)  # and the body read deadline (pagoda/security/timeouts.py)
    install_blob_policy(app, blob_policy)  # and the start-up prune of unused blobs
    if args.grpc_port is not None:  # the gRPC service on the same engine (pagoda/entrypoints/grpc_api)
        from pagoda.entrypoints.grpc_api.service import attach_grpc  # deferred: loads grpc

        attach_grpc(app, args.host, args.grpc_port, api_key, args.shutdown_timeout, tls.grpc_credentials(args))
    print(f"pagoda: serving on http{'s' if ssl_kwargs else ''}://{args.host}:{args.port}/v1"
          f"{' (client certificates required)' if 'ssl_ca_certs' in ssl_kwargs else ''}", flush=True)
    # What is built by now (model, tokenizer, app: ~330k objects) lives until exit. Frozen, the
    # cyclic GC's full collections skip it; they walked it all, a ~0.3 s pause of the event loop
    # every few thousand tokens (benchmarks/README.md, "Server cost per token").
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                            # uvicorn's own deadline, a backstop behind the drain in _Server
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, **ssl_kwargs)
    if args.read_timeout:  # slowloris: a deadline on request heads (pagoda/security/timeouts.py)

        config.http = head_deadline_protocol(args.read_timeout)
    server = DrainingServer(config, app, engines, args.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        engines.shutdown()
        sock.close()
        # Frozen objects escape the interpreter's last collection, so the nanobind extension
        # among them (triton's libtriton, loaded by torch._dynamo) printed ~27 lines of
        # "nanobind: leaked ..." on every exit. Unfrozen, they are collected like any others.
        gc.unfreeze()
    print("pagoda: stopped", flush=True)
    return server.exit_code


def _durable_options(args, name: str) -> DurableOptions:
    """Where this model's app keeps its state (--state-dir; by default its own directory, named
    after the model and the port, so that a restart finds it), and its bounds."""
    state_dir = args.state_dir
    if state_dir is None:
        state_dir = default_state_dir(name, args.port)
    elif state_dir == "none":
        state_dir = None
    elif serves_several(args):
        state_dir = Path(state_dir) / name  # one database per model
    return DurableOptions(state_dir, args.session_ttl, args.max_sessions, args.max_stored_responses,
                          args.batch_concurrency)


def _model_app(args, config, names: list[str], api_key: str | None, metric_families=None) -> tuple[FastAPI, AsyncLLM]:
    """One model's engine and app, from serve's options (`args.model` and its engine flags)."""
    # the core is built where it runs: its thread or its process
    async_engine = AsyncLLM(config, engine_process=args.engine_process, max_engine_restarts=args.max_engine_restarts)
    app = build_app(async_engine, names, api_key=api_key, max_queue_len=args.max_queue_len, model_root=args.model,
                    request_timeout=args.request_timeout, durable=_durable_options(args, names[0]),
                    moderation_words=getattr(args, "moderation_words", None),
                    moderation_action=getattr(args, "moderation_action", "stop"), metric_families=metric_families,
                    web_ui=not getattr(args, "no_web_ui", False), reasoning_parser=args.reasoning_parser,
                    tool_call_parser=args.tool_call_parser, lora_modules=getattr(args, "lora_modules", None),
                    ready_when=getattr(args, "ready_when", "loaded"))
    return app, async_engine


def _one_model_app(args, engine_args, api_key: str | None) -> tuple[FastAPI, AsyncLLM]:
    names = args.served_model_name or [args.model]
    app, async_engine = _model_app(args, create_engine_config(engine_args), names, api_key)
    engine = async_engine
    cfg = engine.config.model
    print(f"pagoda {__version__}: loaded {args.model} ({cfg.architecture}, "
          f"{'pooling: ' + cfg.pooler.pooling_type + ' embeddings, ' if cfg.pools else ''}"
          f"{str(cfg.dtype).removeprefix('torch.')}, "
          f"{cfg.device.type}, max_model_len={engine.max_model_len}, KV blocks={async_engine.limits.num_blocks}, "
          f"tensor_parallel_size={engine.config.parallel.tensor_parallel_size}, "
          f"engine in a {'process' if args.engine_process else 'thread'}, {torch.get_num_threads()} threads, "
          f"{openmp_settings()}) as {', '.join(names)}", flush=True)
    if app.state.serving.moderation.base is not None:  # --moderation-words
        word_filter = app.state.serving.moderation.base.filter
        print(f"pagoda: content filter: {word_filter.num_terms} terms in {', '.join(word_filter.names)} "
              f"(--moderation-action {args.moderation_action})", flush=True)
    return app, async_engine


def _several_models_settings(args):
    """The models and the pool's settings of serve's options, each model's files resolved (a
    model that does not exist fails here, before the server starts)."""
    specs = model_specs(args)
    for spec in specs:
        spec.config = create_engine_config(EngineArgs.from_cli_args(spec.args))
    if args.max_loaded_models < 1:
        raise ValueError(f"--max-loaded-models must be >= 1, got {args.max_loaded_models}")
    if args.models_memory is not None and args.models_memory <= 0:
        raise ValueError(f"--models-memory must be > 0 GiB, got {args.models_memory}")
    if args.load_timeout <= 0:
        raise ValueError(f"--load-timeout must be > 0 seconds, got {args.load_timeout}")
    budget = int(args.models_memory * (1 << 30)) if args.models_memory is not None else default_memory_budget()
    return specs, (budget, args.max_loaded_models, args.load_timeout)


def _pooled_model_app(spec, families) -> tuple[FastAPI, AsyncLLM]:
    """One model of the pool, returned loaded: the pool counts its memory and its failure once it
    says it has loaded (a model that loads layer by layer is waited for)."""
    app, engine = _model_app(spec.args, spec.config, spec.names, None, families)
    try:
        engine.wait_until_loaded()
    except Exception:  # the loader's own error (a ValueError names a bad file's tensor)
        engine.shutdown()
        raise
    return app, engine


def _several_models_app(args, specs, settings, api_key: str | None):
    """The front app of several models and their pool (pagoda/entrypoints/model_dispatch.py)."""
    from pagoda.entrypoints.prometheus import MetricFamilies  # deferred: loads prometheus_client

    families = MetricFamilies()
    budget, max_loaded, load_timeout = settings
    pool: ModelPool | None = None
    pool = ModelPool(specs, load=lambda spec: _pooled_model_app(spec, families),
                     memory_budget=budget, max_loaded=max_loaded,
                     load_timeout=load_timeout, metrics=PoolMetrics(families, lambda: pool))
    for spec in specs:
        cfg = spec.config.model
        print(f"pagoda {__version__}: serving {spec.args.model} ({cfg.architecture}, "
              f"{str(cfg.dtype).removeprefix('torch.')}, about {format_gib(footprint_bytes(spec.config))}) as "
              f"{', '.join(spec.names)}; {'loaded at start-up' if spec.preload else 'loads on first use'}", flush=True)
    print(f"pagoda: up to {max_loaded} models loaded at once within {format_gib(budget)} (--max-loaded-models, "
          f"--models-memory); idle models unload after their keep_alive", flush=True)
    return build_front_app(pool, families, api_key=api_key, web_ui=not getattr(args, "no_web_ui", False)), pool
