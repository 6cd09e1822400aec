"""Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from pagoda.engine.async_llm import AsyncLLM, EngineUnavailableError, ShuttingDownError
from pagoda.engine.beam_search import beam_search_async
from pagoda.entrypoints.openai.admission import AdmissionChecks
from pagoda.entrypoints.openai.chat import ChatServing
from pagoda.entrypoints.openai.completion import CompletionServing
from pagoda.entrypoints.openai.errors import OpenAIError, bad_value
from pagoda.entrypoints.openai.lora_routes import ServedAdapters
from pagoda.entrypoints.openai.pooling import PoolingServing
from pagoda.entrypoints.openai.protocol import SamplingFields
from pagoda.entrypoints.openai.reasoning import ReasoningFormat
from pagoda.entrypoints.openai.tool_formats import ToolCallFormat, tool_call_format
from pagoda.entrypoints.openai.response_parts import Sample
from pagoda.multimodal.inputs import images_of
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import BeamSearchParams
from pagoda.security.context import (
    request_context,  # --auth-config / --audit-log (pagoda/security/access.py)
)

logger = logging.getLogger("pagoda.requests")


class Serving(AdmissionChecks, CompletionServing, ChatServing, PoolingServing):
    """One served model's OpenAI front: the checks that admit a request (admission.py), the
    completion and chat paths (completion.py, chat.py), the pooling path (pooling.py: embeddings,
    scores) and what they share here: sampling parameters and running prompts through the engine."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], max_queue_len: int | None = None,
                 aliases: Sequence[str] = (), request_timeout: float | None = None, metric_families=None) -> None:
        from pagoda.entrypoints.prometheus import ServerMetrics  # deferred: loads prometheus_client

        self.engine = engine
        # metric_families: the server's shared registry when it serves several models
        self.metrics = ServerMetrics(engine, served_model_names[0], metric_families)
        self.tokenizer = engine.tokenizer
        self.model_names = served_model_names
        # What a request's `model` may say: the served names, then other names of the same model
        # (a catalog model's name and aliases), in the order the 404 lists them.
        self.accepted_names = list(dict.fromkeys([*served_model_names, *aliases]))
        self._max_token_chars: int | None = None
        self.max_model_len = engine.max_model_len
        self.max_queue_len = max_queue_len
        self.admitted = 0  # engine requests of the HTTP requests admitted and not yet answered
        self.background = 0  # batch lines running (batch_runner.py), at a priority below every request
        self.request_timeout = request_timeout  # seconds a request may live (--request-timeout)
        # The content filter (pagoda/security/moderation.py: --moderation-words, a role's lists); build_app sets it
        self.moderation = None
        self.sampling_defaults = engine.sampling_defaults  # the model's own (--generation-config)
        self.reasoning: ReasoningFormat | None = None  # --reasoning-parser (reasoning.py); build_app sets it
        self.tool_format: ToolCallFormat = tool_call_format(None)  # --tool-call-parser (tool_formats.py)
        self.adapters: ServedAdapters | None = None  # --enable-lora's adapters by name (lora_routes.py)

    def params(self, request: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None):
        try:
            return request.sampling_params(max_tokens, logprobs, prompt_logprobs, self.sampling_defaults)
        except ValueError as e:
            raise bad_value(e) from None

    async def run_all(self, prompts: list[list[int]], params_list, request_id: str, priority: int,
                       cache_salt: str | None = None, session_id: str | None = None,
                       model: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run several prompts concurrently; yield (prompt index, delta output) as they arrive.
        `session_id` makes them turns of a session (/v1/sessions): the engine keeps the prefix.
        `model`: the request's model, which may name a LoRA adapter (checked by check_model)."""
        adapter = self.adapter_for(model)
        merged: asyncio.Queue = asyncio.Queue()
        moderation = self.moderation.for_request() if self.moderation is not None else None  # output filter
        ctx = request_context()  # auth: the role's priority and max_tokens, the tenant's cache salt; usage
        if ctx is not None:
            priority, cache_salt = ctx.engine_args(priority, cache_salt)
            for params in params_list:
                if isinstance(params, BeamSearchParams):  # the role's max_tokens; a beam has no min_tokens
                    params.max_tokens = min(params.max_tokens, ctx.max_tokens or params.max_tokens)
                else:
                    ctx.cap_params(params)
        content = ctx is not None and ctx.outputs is not None  # --audit-log-content

        async def pump(i: int, ids: list[int], params) -> None:
            tracker = self.metrics.tracker(len(ids))
            sub_id, reason, cached = f"{request_id}-{i}", "abort", 0
            try:
                async for out in self._generate(ids, params, sub_id, priority, cache_salt, session_id, moderation,
                                                adapter):
                    tracker.on_output(out)
                    cached = out.num_cached_tokens
                    if content:
                        ctx.on_output(i, out)
                    if out.finished:
                        reason = ",".join(sorted({c.finish_reason or "abort" for c in out.outputs}))
                    await merged.put((i, out))
            except asyncio.CancelledError:  # the client went away, or the request timed out
                reason = "abort"
                raise
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                reason = "abort" if isinstance(e, ShuttingDownError) else "error"
                await merged.put((i, e))
            finally:
                elapsed = tracker.on_finish(reason)
                logger.info("request %s: %d prompt tokens, %d generated, %s, %.3fs (ttft %.3fs)", sub_id, len(ids),
                            tracker.generated, reason, elapsed,
                            (tracker.first_token_at - tracker.start) if tracker.first_token_at else float("nan"))
                if ctx is not None:  # auth / audit: the tokens used (tokens_per_minute, the audit line)
                    ctx.on_engine_done(i, ids, tracker.generated, cached or 0, self.tokenizer)
                await merged.put((i, None))

        tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(zip(prompts, params_list))]
        remaining = len(tasks)
        deadline = None if self.request_timeout is None else asyncio.get_running_loop().time() + self.request_timeout
        try:
            while remaining:
                # Not `asyncio.timeout` around the loop: this generator yields, and a streaming
                # response's task would be cancelled wherever it is between two chunks.
                i, item = await (merged.get() if deadline is None else self._before(deadline, merged.get()))
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise _as_openai_error(item, self.engine.healthy)
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _generate(self, ids: list[int], params, request_id: str, priority: int, cache_salt: str | None,
                        session_id: str | None, moderation, adapter=None) -> AsyncIterator[RequestOutput]:
        """One prompt's outputs from the engine: its deltas, or a beam search's one final output
        (engine/beam_search.py: its beams as one-token requests, the best as the choices)."""
        if not isinstance(params, BeamSearchParams):
            async for out in self.engine.generate({"prompt_token_ids": ids}, params, request_id, priority, cache_salt,
                                                  session_id, moderation=moderation, lora_request=adapter):
                yield out
            return
        if adapter is not None:
            raise OpenAIError(f"beam search does not run under a LoRA adapter ({adapter.lora_name!r}) yet",
                              param="use_beam_search")
        if images_of(ids):  # (its beams are prompts of token ids: the images would not go with them)
            raise OpenAIError("beam search does not take images yet", param="use_beam_search")
        yield await beam_search_async(self.engine, ids, params, request_id, priority, cache_salt, moderation)

    async def _before(self, deadline: float, waiting):
        """Await `waiting` until the loop time `deadline` (--request-timeout), else a 504."""
        try:
            return await asyncio.wait_for(waiting, max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise OpenAIError(f"the request did not finish within the server's request timeout "
                              f"({self.request_timeout:g} s) and was aborted", status=504, type_="timeout_error",
                              code="request_timeout", headers={"x-should-retry": "false"}) from None

    async def _collect(self, prompts: list[list[int]], params_list, request_id: str, request: SamplingFields,
                       session_id: str | None = None, model: str | None = None):
        """Run prompts to the end (non-streaming). Returns the samples by (prompt index, sample
        index), the prompt logprobs by prompt index, and the prompt tokens served from cache."""
        samples: dict[tuple[int, int], Sample] = {}
        prompt_logprobs: dict[int, list] = {}
        cached: dict[int, int] = {}
        async for i, out in self.run_all(prompts, params_list, request_id, request.priority, request.cache_salt,
                                         session_id, model):
            cached[i] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            for c in out.outputs:
                samples.setdefault((i, c.index), Sample()).add(c)
        return samples, prompt_logprobs, sum(cached.values())

def _as_openai_error(error: BaseException, engine_healthy: bool) -> OpenAIError:
    """What a request's failure looks like to its client: 400 for bad input, 503 when the engine
    is gone or the server is stopping, else 500; an OpenAIError (a check on the way in) as it is."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, ValueError):
        return bad_value(error)
    if isinstance(error, EngineUnavailableError) or not engine_healthy:
        code = "shutting_down" if isinstance(error, ShuttingDownError) else "engine_unavailable"
        return OpenAIError(str(error), status=503, type_="server_error", code=code)
    return OpenAIError(str(error), status=500, type_="server_error")
