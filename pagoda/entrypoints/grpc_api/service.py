"""The gRPC service `pagoda.v1.Engine` (pagoda.proto) on the HTTP server's engine.

A request is turned into the HTTP API's own request object (CompletionRequest /
ChatCompletionRequest) and goes through the same `Serving` checks: model name, prompt length,
sampling validation, the engine-level limit; so gRPC and HTTP accept and refuse the same things.
Errors become status codes (`OpenAIError.status` → `STATUS_CODES`), a field error names the
field. The answer streams one `GenerateResponse` per engine delta. A client that cancels, or
whose deadline passes, cancels the handler; the engine request is aborted and its KV blocks freed
(`AsyncLLM.generate`'s `finally`). The API key travels as `authorization: Bearer KEY` metadata.
The standard health service (`grpc.health.v1`) and server reflection are served beside it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hmac
import inspect
import json
import logging
from collections.abc import AsyncIterator

import grpc
from pydantic import ValidationError

from pagoda.entrypoints.grpc_api import pagoda_pb2 as pb
from pagoda.entrypoints.grpc_api import pagoda_pb2_grpc as pb_grpc
from pagoda.entrypoints.openai.pooling_protocol import EmbeddingRequest
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, random_id
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.serving import Serving
from pagoda.entrypoints.openai.choice_parser import ChoiceParser, ParsedChoice
from pagoda.outputs import RequestOutput
from pagoda.security.access import grpc_context
from pagoda.security.context import CURRENT, RequestContext, request_context

logger = logging.getLogger("pagoda.grpc")

SERVICE_NAME = "pagoda.v1.Engine"
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "min_tokens", "logprobs", "cache_salt", "speculative")


def _audited(handler):
    """With --audit-log, one line per call, as the HTTP API writes one per request: the same
    fields, `method` "gRPC", `path` /pagoda.v1.Engine/<RPC>, `status` the gRPC code's name."""
    rpc = handler.__name__
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def streaming(self, request, context):
            with self._audit_call(rpc, context):
                async for piece in handler(self, request, context):
                    yield piece
        return streaming

    @functools.wraps(handler)
    async def unary(self, request, context):
        with self._audit_call(rpc, context):
            return await handler(self, request, context)
    return unary


def _code_name(context) -> str:
    code = context.code() if hasattr(context, "code") else None
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


def _audit_end(access, rpc: str, code: str, context) -> None:
    ctx = request_context() or RequestContext(None)
    access.audit.write(access.audit_record(ctx, code, "gRPC", f"/{SERVICE_NAME}/{rpc}", context.peer()))


class EngineService(pb_grpc.EngineServicer):
    def __init__(self, serving: Serving, api_key: str | None = None, draining=lambda: False) -> None:
        """``draining``: whether the server is stopping (new calls then get UNAVAILABLE)."""
        self.serving = serving
        self.api_key = api_key
        self.draining = draining

    # -- the RPCs -----------------------------------------------------------------------------
    @_audited
    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        body = await self._checked(context, lambda: CompletionRequest(**_completion_fields(request)))
        try:
            # off the event loop, as HTTP does: a prompt's tokenizing and its grammar take time
            model, prompts, params_list = await asyncio.to_thread(self.serving.prepare_completion, body)
        except OpenAIError as e:
            await _abort(context, e)
        async for piece in self._stream(context, [ids for _, ids in prompts], params_list, body, "cmpl"):
            yield piece

    @_audited
    async def Chat(self, request: pb.ChatRequest, context) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        body = await self._checked(context, lambda: ChatCompletionRequest(**_chat_fields(request)))
        try:
            _, ids, params, tools = await asyncio.to_thread(self.serving.prepare_chat, body)
        except OpenAIError as e:
            await _abort(context, e)
        parser = self.serving.choice_parser(tools, ids, params.structured_outputs is not None)
        async for piece in self._stream(context, [ids], [params], body, "chatcmpl", parser):
            yield piece

    @_audited
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:  # noqa: N802
        await self._authorize(context)
        try:
            self.serving.check_model(request.model or None)
            if request.WhichOneof("input") == "chat":
                body = await self._checked(context, lambda: ChatCompletionRequest(**_chat_fields(request.chat)))
                ids = self.serving.encode_chat(self.serving.chat_messages(body.messages), True)
            else:
                self.serving.check_prompt_chars(len(request.prompt))
                ids = self.serving.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        except OpenAIError as e:
            await _abort(context, e)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.serving.max_model_len)

    @_audited
    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:  # noqa: N802
        await self._authorize(context)
        try:
            self.serving.check_model(request.model or None)
        except OpenAIError as e:
            await _abort(context, e)
        vocab = self.serving.tokenizer.vocab_size
        bad = [t for t in request.token_ids if not 0 <= t < vocab]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: {bad[:5]} are not in [0, {vocab})")
        return pb.DetokenizeResponse(text=self.serving.tokenizer.decode(list(request.token_ids)))

    @_audited
    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:  # noqa: N802
        await self._authorize(context)
        ctx = request_context()  # --auth-config: only the names the key's role may use
        served = [*self.serving.model_names, *(self.serving.adapters.by_name if self.serving.adapters else ())]
        names = ctx.visible(served) if ctx is not None else served  # (LoRA adapters after the model)
        return pb.ListModelsResponse(models=[pb.Model(id=name, max_model_len=self.serving.max_model_len)
                                             for name in names])

    @_audited
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:  # noqa: N802
        """/v1/embeddings' checks and path (Serving.encode_all), its vectors as floats."""
        body = await self._checked(context, lambda: EmbeddingRequest(**_embed_fields(request)))
        admission = self.serving.admission()
        try:
            self.serving.check_model(body.model)
            self.serving.check_capacity(len(body.input), admission)
            params = body.pooling_params("embed", dimensions=body.dimensions, normalize=body.normalize)
            outputs = await self.serving.encode_all(body.input, params, random_id("embd"), body.priority)
        except OpenAIError as e:
            await _abort(context, e)
        except ValueError as e:  # PoolingParams' checks: the message names the field
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        finally:
            admission.release()
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=o.outputs.data.tolist(),
                                                         prompt_tokens=len(o.prompt_token_ids)) for o in outputs],
                                usage=pb.Usage(prompt_tokens=tokens))

    # -- shared -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _audit_call(self, rpc: str, context):
        """With --audit-log, the call's line once it ends (status OK, CANCELLED or the code it was
        aborted with); the call gets a request context for the serving hooks to fill, if the key
        check gives it none. Without an audit log, nothing."""
        access = getattr(self.serving, "access", None)
        if access is None or access.audit is None:
            yield
            return
        if request_context() is None:
            CURRENT.set(RequestContext(None, access.keep_content))
        code = "OK"
        try:
            yield
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except BaseException:
            code = _code_name(context)
            raise
        finally:
            _audit_end(access, rpc, code, context)

    async def _authorize(self, context) -> None:
        if self.draining():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        access = getattr(self.serving, "access", None)  # --auth-config / --audit-log: the HTTP API's keys and roles
        if access is not None and access.checks_keys:
            try:  # the call's context, read by the serving hooks (pagoda/security/context.py)
                grpc_context(access, context.invocation_metadata())
            except OpenAIError as e:  # 401 → UNAUTHENTICATED, 429 → RESOURCE_EXHAUSTED
                await _abort(context, e)
            return
        if self.api_key is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        given = metadata.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required "
                                "(metadata 'authorization: Bearer KEY')")

    async def _checked(self, context, build):
        """The HTTP API's request object, or INVALID_ARGUMENT naming the field it refused."""
        await self._authorize(context)
        try:
            return build()
        except ValidationError as e:
            error = e.errors()[0]
            field = ".".join(str(p) for p in error["loc"])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {error['msg']}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _stream(self, context, prompts: list[list[int]], params_list, body, prefix: str,
                      parser: ChoiceParser | None = None):
        """Run the prompts under the engine-level limit; one response per engine delta. A chat's
        last piece carries its reasoning and tool calls, parsed from the whole answer (`parser`)."""
        admission = self.serving.admission()
        try:
            try:
                self.serving.check_runner("generate")  # an embedding model generates nothing
                self.serving.check_capacity(len(prompts), admission)
            except OpenAIError as e:
                await _abort(context, e)
            request_id = random_id(prefix)
            completion_tokens, pieces = 0, []
            try:
                async for _, out in self.serving.run_all(prompts, params_list, request_id, body.priority,
                                                         body.cache_salt, model=body.model):
                    piece = _piece(request_id, out, params_list[0].logprobs or 0)
                    completion_tokens += len(piece.token_ids)
                    pieces.append((piece.text, len(piece.token_ids)))
                    if piece.finish_reason and parser is not None:
                        _attach_parsed(piece, parser.whole(pieces))
                    if piece.finish_reason:
                        piece.usage.CopyFrom(pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                                                      completion_tokens=completion_tokens,
                                                      cached_tokens=out.num_cached_tokens))
                    yield piece
            except OpenAIError as e:
                await _abort(context, e)
        finally:
            admission.release()


def _attach_parsed(piece: pb.GenerateResponse, parsed: ParsedChoice) -> None:
    """The reasoning and the calls of the whole answer, as the HTTP API parses them;
    finish_reason "tool_calls" when there are calls."""
    piece.reasoning = parsed.reasoning or ""
    piece.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in parsed.calls)
    if parsed.calls and piece.finish_reason == "stop":
        piece.finish_reason = "tool_calls"


def _piece(request_id: str, out: RequestOutput, k: int) -> pb.GenerateResponse:
    """One engine delta as a response; ``k``: top logprobs asked for (each position holds the
    chosen token and the k most likely, the chosen one among them or not)."""
    c = out.outputs[0]
    piece = pb.GenerateResponse(request_id=request_id, text=c.text, token_ids=c.token_ids,
                                finish_reason=c.finish_reason or "",
                                stop_reason="" if c.stop_reason is None else str(c.stop_reason))
    for token, position in zip(c.token_ids, c.logprobs or ()):
        top = sorted(position.items(), key=lambda item: -item[1].logprob)[:k]
        piece.logprobs.append(pb.TokenLogprob(token_id=token, logprob=position[token].logprob,
                                              top_token_ids=[t for t, _ in top],
                                              top_logprobs=[lp.logprob for _, lp in top]))
    return piece


async def _abort(context, error: OpenAIError) -> None:
    code = STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)
    message = f"{error.param}: {error.message}" if error.param and not error.message.startswith(error.param) \
        else error.message
    await context.abort(code, message)


def _embed_fields(request: pb.EmbedRequest) -> dict:
    """An EmbedRequest under /v1/embeddings' names (its unset optional fields left out)."""
    fields = {name: getattr(request, name) for name in ("dimensions", "normalize", "truncate_prompt_tokens")
              if request.HasField(name)}
    return {"model": request.model or None, "input": list(request.input), "priority": request.priority, **fields}


def _sampling(options: pb.SamplingOptions) -> dict:
    """The SamplingOptions that are set, under the HTTP API's names."""
    fields = {name: getattr(options, name) for name in _SAMPLING_FIELDS if options.HasField(name)}
    if options.stop:
        fields["stop"] = list(options.stop)
    if options.stop_token_ids:
        fields["stop_token_ids"] = list(options.stop_token_ids)
    if options.ignore_eos:
        fields["ignore_eos"] = True
    fields["priority"] = options.priority
    constraint = {}
    if options.HasField("json_schema"):
        constraint["json"] = options.json_schema
    if options.HasField("regex"):
        constraint["regex"] = options.regex
    if options.choice:
        constraint["choice"] = list(options.choice)
    if constraint:
        fields["structured_outputs"] = constraint
    return fields


def _completion_fields(request: pb.GenerateRequest) -> dict:
    prompt = list(request.prompt_token_ids.ids) if request.WhichOneof("input") == "prompt_token_ids" else request.prompt
    fields = {"model": request.model or None, "prompt": prompt, "stream": True, **_sampling(request.sampling)}
    if request.HasField("sampling") and request.sampling.HasField("logprobs"):
        fields["logprobs"] = request.sampling.logprobs
    return fields


def _chat_fields(request: pb.ChatRequest) -> dict:
    fields = {"model": request.model or None, "stream": True, **_sampling(request.sampling),
              "messages": [_chat_message(m) for m in request.messages]}
    if "logprobs" in fields:  # chat's own shape: a flag and top_logprobs
        fields["top_logprobs"] = fields.pop("logprobs")
        fields["logprobs"] = True
    for name in ("tools", "tool_choice", "response_format"):
        if request.HasField(f"{name}_json"):
            try:
                fields[name] = json.loads(getattr(request, f"{name}_json"))
            except ValueError as e:
                raise ValueError(f"{name}_json is not valid JSON: {e}") from None
    return fields


def _chat_message(message: pb.ChatMessage) -> dict:
    content: str | list[dict] = message.content
    if message.images:  # the HTTP API's parts: the same checks and 400s (entrypoints/openai/chat_images.py)
        content = [{"type": "image_url", "image_url": {"url": "data:image/*;base64," + base64.b64encode(image).decode()}}
                   for image in message.images] + [{"type": "text", "text": message.content}]
    out: dict = {"role": message.role, "content": content}
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    return out


def add_health_and_reflection(server) -> None:
    """grpc.health.v1 (SERVING for the engine service and the server) and server reflection."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # deferred: grpc_health loads on first use
    from grpc_reflection.v1alpha import reflection  # deferred: grpc_reflection loads on first use

    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return checker, health_pb2


def attach_grpc(app, host: str, port: int, api_key: str | None, grace: float, credentials=None) -> None:
    """Run the gRPC service with the HTTP app: started when the app starts (in its event loop,
    on its engine), stopped when it stops, in-flight calls given ``grace`` seconds. With
    ``credentials`` (grpc.ssl_server_credentials: pagoda/security/tls.py), over TLS."""
    state = {}

    async def start() -> None:
        state["server"] = await start_grpc_server(app.state.serving, host, port, api_key,
                                                  lambda: app.state.lifecycle.draining, credentials)
        print(f"pagoda: gRPC ({SERVICE_NAME}) on {host}:{port}", flush=True)

    async def stop() -> None:
        if "server" in state:
            await state["server"].stop(grace)

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)


async def start_grpc_server(serving: Serving, host: str, port: int, api_key: str | None = None,
                            draining=lambda: False, credentials=None):
    """Serve `pagoda.v1.Engine` (and health, reflection) on host:port in this event loop; returns
    the started `grpc.aio.Server` (stop it with `await server.stop(grace)`)."""
    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(EngineService(serving, api_key, draining), server)
    checker, health_pb2 = add_health_and_reflection(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("gRPC service %s on %s", SERVICE_NAME, address)
    return server
