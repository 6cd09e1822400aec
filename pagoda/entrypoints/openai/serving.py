"""Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from collections.abc import AsyncIterator, Callable, Sequence

import orjson

from pagoda.engine.async_llm import AsyncLLM, EngineUnavailableError, ShuttingDownError
from pagoda.entrypoints.openai.errors import OpenAIError, bad_value
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields, UsageInfo, now, random_id,
)
from pagoda.entrypoints.openai.tool_calls import ToolCallStream, ToolChoice, render_messages
from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagoda.security.context import request_context  # --auth-config / --audit-log (pagoda/security/access.py)
from pagoda.structured_output.grammar import validate_structured_outputs

logger = logging.getLogger("pagoda.requests")


def dumps(data) -> bytes:
    """A response body or SSE payload as JSON: compact, UTF-8 text unescaped, keys that are not
    strings written as strings (as json.dumps does). Non-finite floats, which JSON cannot carry,
    become null (json.dumps wrote `-Infinity`, which strict parsers reject)."""
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)


def sse(data: dict | str) -> bytes:
    """One server-sent event: a JSON object, or a bare string such as [DONE]."""
    return b"data: " + (data.encode() if isinstance(data, str) else dumps(data)) + b"\n\n"


class Admission:
    """What one HTTP request holds of the engine-level limit (Serving.check_capacity), given back
    once when its answer is done (api_server.respond)."""

    def __init__(self, serving: Serving) -> None:
        self.serving, self.held = serving, 0
        self.tenant_slot = None  # auth: the RequestContext holding a tenant's concurrency slot

    def take(self, n: int) -> None:
        self.serving.admitted += n
        self.held += n

    def release(self) -> None:
        self.serving.admitted -= self.held
        self.held = 0
        if self.tenant_slot is not None:
            self.tenant_slot.release()
            self.tenant_slot = None


class Serving:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], max_queue_len: int | None = None,
                 aliases: Sequence[str] = (), request_timeout: float | None = None, metric_families=None) -> None:
        from pagoda.entrypoints.prometheus import ServerMetrics  # deferred: loads prometheus_client

        self.engine = engine
        # metric_families: the server's shared registry when it serves several models
        self.metrics = ServerMetrics(engine, served_model_names[0], metric_families)
        self.tokenizer = engine.engine.tokenizer
        self.model_names = served_model_names
        # What a request's `model` may say: the served names, then other names of the same model
        # (a catalog model's name and aliases), in the order the 404 lists them.
        self.accepted_names = list(dict.fromkeys([*served_model_names, *aliases]))
        self._max_token_chars: int | None = None
        self.max_model_len = engine.engine.max_model_len
        self.max_queue_len = max_queue_len
        self.admitted = 0  # engine requests of the HTTP requests admitted and not yet answered
        self.request_timeout = request_timeout  # seconds a request may live (--request-timeout)
        # The content filter (pagoda/security/moderation.py: --moderation-words, a role's lists); build_app sets it
        self.moderation = None
        self.sampling_defaults = engine.engine.sampling_defaults  # the model's own (--generation-config)

    # -- shared checks ----------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The served name for a request's `model` (any accepted name; none means the served one)."""
        ctx = request_context()  # auth: the role may use this name (403; the 404 lists only those), the audit's model
        if model is None or model in self.accepted_names:
            if ctx is not None:
                ctx.check_model(model or self.model_names[0])
            return self.model_names[0]
        names = ", ".join(f"`{name}`" for name in (ctx.visible(self.accepted_names) if ctx else self.accepted_names))
        raise OpenAIError(f"The model `{model}` does not exist. This server serves {names}.", status=404,
                          type_="NotFoundError", param="model", code="model_not_found")

    def admission(self) -> Admission:
        return Admission(self)

    def check_capacity(self, new_requests: int, admission: Admission | None = None) -> None:
        """The engine-level limit (`--max-queue-len`): up to `--max-num-seqs` requests run and at
        most `--max-queue-len` more wait; past that, 429 at once instead of an unbounded queue.
        Counted as requests admitted (running + waiting) against the sum of the two, settled the
        moment a request arrives: a burst waits in the engine's queue until the next step
        schedules it, so "waiting" alone would refuse requests that can run. The count is the
        HTTP requests admitted and not yet answered (`admission` takes its share at once), not
        the engine's: a request reaches the engine a few awaits after this check, and a burst
        that arrives in one go would all pass a check of the engine's count."""
        ctx = request_context()
        if ctx is not None and admission is not None and admission.tenant_slot is None:
            ctx.admit()  # auth: the tenant's max_concurrent and tokens_per_minute (429), held to the end
            admission.tenant_slot = ctx
        if self.max_queue_len is None:
            return
        running = self.engine.engine.config.scheduler.max_num_seqs
        if max(self.admitted, self.engine.num_pending) + new_requests > running + self.max_queue_len:
            raise OpenAIError(f"the server is full ({running} requests running, --max-num-seqs, and "
                              f"{self.max_queue_len} waiting, --max-queue-len); retry later", status=429,
                              type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        if admission is not None:
            admission.take(new_requests)

    def max_tokens_for(self, requested: int | None, prompt_len: int, prompt_param: str = "prompt") -> int:
        """The completion's token budget. A prompt that leaves no room is the prompt's fault (param
        `prompt`, or `messages` for chat) whatever max_tokens says; max_tokens is named only when
        the prompt fits but the two together do not."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"{_subject(prompt_param)} {prompt_len} tokens, leaving no room to generate. Please "
                              f"shorten the {prompt_param}.", param=prompt_param, code="context_length_exceeded")
        ctx = request_context()
        cap = ctx.check_max_tokens(requested) if ctx is not None else None  # auth: the role's max_tokens (400 past it)
        if requested is None and cap is not None:  # ... and the default within it
            return min(room, cap, self.sampling_defaults.get("max_tokens", cap))
        if requested is None:  # the model's default (generation_config max_new_tokens), else all the room
            return min(room, self.sampling_defaults.get("max_tokens", room))
        if requested < 1:
            raise OpenAIError(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if prompt_len + requested > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
                "Please reduce the prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
        return requested

    @property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: the longest vocabulary entry (a byte-level
        entry has one character per byte, so it never covers more characters than its length)."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.convert_ids_to_tokens(range(self.tokenizer.vocab_size))
            self._max_token_chars = max(max(map(len, vocab), default=1), 1)
        return self._max_token_chars

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing it, text longer than the whole context could hold even if every
        token were the longest in the vocabulary: tokenizing a 10 MB prompt held the event loop for
        ~12 s only to find it too long. Text within the bound costs at most that many characters of
        tokenizing (3.3k on the tiny test model; ~8k tokens x the longest entry for a real one)."""
        limit = self.max_model_len * self.max_token_chars
        if num_chars > limit:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"{_subject(param)} {num_chars} characters, more than {self.max_model_len} tokens can "
                              f"hold (at most {limit}). Please shorten the {param}.", param=param,
                              code="context_length_exceeded")

    def check_input(self, texts, param: str = "prompt") -> None:
        """The content filter on a request's text, before it is tokenized: a term of a word list
        is a 400 `content_filter` that names the list, not the text."""
        moderation = self.moderation.for_request() if self.moderation is not None else None
        name = moderation.check_input(texts) if moderation is not None else None
        if name is not None:
            raise OpenAIError(f"the {param} was refused by the content filter: it holds a term of the word list "
                              f"`{name}`", param=param, code="content_filter")

    def params(self, request: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None):
        try:
            return request.sampling_params(max_tokens, logprobs, prompt_logprobs, self.sampling_defaults)
        except ValueError as e:
            raise bad_value(e) from None

    async def run_all(self, prompts: list[list[int]], params_list, request_id: str, priority: int,
                       cache_salt: str | None = None,
                       session_id: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run several prompts concurrently; yield (prompt index, delta output) as they arrive.
        `session_id` makes them turns of a session (/v1/sessions): the engine keeps the prefix."""
        merged: asyncio.Queue = asyncio.Queue()
        moderation = self.moderation.for_request() if self.moderation is not None else None  # output filter
        ctx = request_context()  # auth: the role's priority and max_tokens, the tenant's cache salt; usage
        if ctx is not None:
            priority, cache_salt = ctx.engine_args(priority, cache_salt)
            for params in params_list:
                ctx.cap_params(params)
        content = ctx is not None and ctx.outputs is not None  # --audit-log-content

        async def pump(i: int, ids: list[int], params) -> None:
            tracker = self.metrics.tracker(len(ids))
            sub_id, reason, cached = f"{request_id}-{i}", "abort", 0
            try:
                async for out in self.engine.generate({"prompt_token_ids": ids}, params, sub_id, priority, cache_salt,
                                                      session_id, moderation=moderation):
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

    async def _before(self, deadline: float, waiting):
        """Await `waiting` until the loop time `deadline` (--request-timeout), else a 504."""
        try:
            return await asyncio.wait_for(waiting, max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise OpenAIError(f"the request did not finish within the server's request timeout "
                              f"({self.request_timeout:g} s) and was aborted", status=504, type_="timeout_error",
                              code="request_timeout", headers={"x-should-retry": "false"}) from None

    async def _collect(self, prompts: list[list[int]], params_list, request_id: str, request: SamplingFields,
                       session_id: str | None = None):
        """Run prompts to the end (non-streaming). Returns the samples by (prompt index, sample
        index), the prompt logprobs by prompt index, and the prompt tokens served from cache."""
        samples: dict[tuple[int, int], _Sample] = {}
        prompt_logprobs: dict[int, list] = {}
        cached: dict[int, int] = {}
        async for i, out in self.run_all(prompts, params_list, request_id, request.priority, request.cache_salt,
                                         session_id):
            cached[i] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            for c in out.outputs:
                samples.setdefault((i, c.index), _Sample()).add(c)
        return samples, prompt_logprobs, sum(cached.values())

    # -- completions ------------------------------------------------------------------------
    def _completion_prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = request.prompt
        if isinstance(p, str):
            items: list = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            items = [p]
        elif isinstance(p, list) and p:
            items = p
        else:
            raise OpenAIError("prompt must be a non-empty string, list of strings, or token ids", param="prompt")
        for item in items:  # every prompt's size before tokenizing any
            if isinstance(item, str):
                self.check_prompt_chars(len(item))
        # the content filter; token ids are checked as the text they decode to (decoded only if a list applies)
        self.check_input(item if isinstance(item, str) else _decoded(self.tokenizer, item) for item in items)
        out = []
        for item in items:
            if isinstance(item, str):
                out.append((item, self.tokenizer.encode(item)))
            else:
                ids = list(item)
                if not ids:
                    raise OpenAIError("prompt token ids must not be empty", param="prompt")
                out.append((None, ids))
        return out

    def prepare_completion(self, request: CompletionRequest):
        """Check a completion request and make its engine inputs: (served model name, prompts as
        (text, token ids), sampling parameters per prompt). Shared with the gRPC service."""
        model = self.check_model(request.model)
        if request.logprobs is not None and not 0 <= request.logprobs <= 20:
            raise OpenAIError(f"logprobs must be in [0, 20], got {request.logprobs}", param="logprobs")
        prompts = self._completion_prompts(request)
        params_list = []
        for _, ids in prompts:
            max_tokens = self.max_tokens_for(request.max_tokens, len(ids))
            prompt_lp = request.logprobs if (request.echo and request.logprobs is not None) else None
            params_list.append(self.params(request, max_tokens, request.logprobs, prompt_lp))
        return model, prompts, params_list

    async def completion(self, request: CompletionRequest, admission: Admission | None = None):
        # Off the event loop: tokenizing and a structured-output grammar take time in proportion to the body.
        model, prompts, params_list = await asyncio.to_thread(self.prepare_completion, request)
        self.check_capacity(len(prompts), admission)
        request_id = random_id("cmpl")
        n = request.n
        ids_only = [ids for _, ids in prompts]
        if request.stream:
            return self._completion_stream(request, model, request_id, prompts, ids_only, params_list)
        samples, prompt_logprobs, cached = await self._collect(ids_only, params_list, request_id, request)
        choices, completion_tokens = [], 0
        for i, (text, ids) in enumerate(prompts):
            for j in range(n):
                sample = samples.get((i, j), _Sample())
                completion_tokens += len(sample.token_ids)
                choice_text = sample.text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(sample.token_ids, sample.logprobs, request.logprobs)
                if request.echo:
                    prompt_text = text if text is not None else self.tokenizer.decode(ids)
                    choice_text = prompt_text + choice_text
                    if logprobs is not None:
                        echoed = prompt_logprobs.get(i) or [None] * len(ids)
                        logprobs = _merge(self._completion_logprobs(ids, echoed, request.logprobs), logprobs)
                choices.append({"index": i * n + j, "text": choice_text, "logprobs": logprobs,
                                "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason})
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {"id": request_id, "object": "text_completion", "created": now(), "model": model, "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens, cached)}

    async def _completion_stream(self, request, model, request_id, prompts, ids_only, params_list):
        created = now()
        n = request.n
        completion_tokens = 0
        try:
            if request.echo:
                for i, (text, ids) in enumerate(prompts):
                    for j in range(n):
                        echo = text if text is not None else self.tokenizer.decode(ids)
                        yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                                   "choices": [{"index": i * n + j, "text": echo, "logprobs": None, "finish_reason": None}]})
            cached = {}
            async for i, out in self.run_all(ids_only, params_list, request_id, request.priority, request.cache_salt):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._completion_logprobs(c.token_ids, c.logprobs or [], request.logprobs)
                    yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": i * n + c.index, "text": c.text, "logprobs": logprobs,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
            if request.stream_options and request.stream_options.include_usage:
                prompt_tokens = sum(len(ids) for ids in ids_only)
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [],
                           "usage": _usage(prompt_tokens, completion_tokens, sum(cached.values()))})
        except OpenAIError as e:
            yield sse(e.body())
        yield sse("[DONE]")

    def _completion_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None], k: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tid, pos in zip(token_ids, positions):
            piece = self.tokenizer.decode([tid], skip_special_tokens=False)
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
            if pos is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(pos[tid].logprob if tid in pos else None)
            top: dict[str, float] = {}
            for _, lp in _top_k(pos, k):
                top.setdefault(lp.decoded_token, lp.logprob)  # alternatives that decode alike: keep the likeliest
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    # -- chat -------------------------------------------------------------------------------
    def _chat_prompt(self, request: ChatCompletionRequest, tools: ToolChoice | None) -> list[int]:
        messages = self.chat_messages(request.messages)
        self.check_input([m["content"] for m in messages], "messages")
        template = self.tokenizer.chat_template or ""
        try:
            messages, extra = render_messages(messages, tools, template_takes_tools="tools" in template)
        except (ValueError, TypeError, KeyError) as e:
            raise OpenAIError(f"messages cannot be rendered with tools: {e!s}", param="messages") from None
        return self.encode_chat(messages, request.add_generation_prompt, **{**extra, **(request.chat_template_kwargs or {})})

    def chat_messages(self, messages: list[ChatMessage]) -> list[dict]:
        """The request's messages as a chat template takes them, text parts joined. 400s name the
        message: a part that is not text, and (before any template renders them) more messages or
        more text than the context could hold."""
        if not messages:
            raise OpenAIError("messages must have at least one message", param="messages")
        if len(messages) > self.max_model_len:
            raise OpenAIError(f"{len(messages)} messages cannot fit in this model's maximum context length of "
                              f"{self.max_model_len} tokens", param="messages", code="context_length_exceeded")
        out = []
        for i, m in enumerate(messages):
            try:
                message = {"role": m.role, "content": m.text()}
            except ValueError as e:
                raise OpenAIError(f"messages.{i}.content: {e}", param=f"messages.{i}.content") from None
            if m.tool_calls:
                message["tool_calls"] = [call.model_dump(exclude_unset=True) for call in m.tool_calls]
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        self.check_prompt_chars(sum(len(m["content"]) for m in out), "messages")
        return out

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool, **template_kwargs) -> list[int]:
        """Render the chat template and tokenize; a template that fails on the messages is a 400."""
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt, **template_kwargs)
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        except Exception as e:  # jinja TemplateError from raise_exception in the template
            raise OpenAIError(f"chat template error: {e}", param="messages") from None

    @staticmethod
    def _tools(request: ChatCompletionRequest) -> ToolChoice | None:
        try:
            return ToolChoice.from_request(request.tools, request.tool_choice, request.parallel_tool_calls)
        except ValueError as e:
            raise OpenAIError(str(e), param="tool_choice" if str(e).startswith("tool_choice") else "tools") from None

    def _constrain_to_tools(self, params, tools: ToolChoice | None) -> None:
        """required / named tool_choice: the output must be the calls' JSON."""
        constraint = tools.constraint() if tools else None
        if constraint is None:
            return
        if params.structured_outputs is not None:
            raise OpenAIError(f"tool_choice={tools.mode!r} constrains the output itself; it cannot be combined with "
                              "response_format or guided decoding", param="tool_choice")
        try:
            validate_structured_outputs(constraint, "tools")
        except ValueError as e:
            raise OpenAIError(str(e), param="tools") from None
        params.structured_outputs = constraint

    def prepare_chat(self, request: ChatCompletionRequest):
        """Check a chat request and make its engine input: (served model name, prompt token ids,
        sampling parameters, the tools it may call). Shared with the gRPC service."""
        model = self.check_model(request.model)
        tools = self._tools(request)
        ids = self._chat_prompt(request, tools)
        params = self.chat_params(request, len(ids))
        self._constrain_to_tools(params, tools)
        return model, ids, params, tools

    def chat_params(self, request: ChatCompletionRequest, prompt_len: int, prompt_param: str = "messages"):
        """A chat request's sampling parameters for a prompt of `prompt_len` tokens (top_logprobs
        and max_tokens checked; shared with /v1/sessions, whose prompt is its `content`)."""
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise OpenAIError(f"top_logprobs must be in [0, 20], got {request.top_logprobs}", param="top_logprobs")
        max_tokens = self.max_tokens_for(request.max_completion_tokens or request.max_tokens, prompt_len, prompt_param)
        k = (request.top_logprobs or 0) if request.logprobs else None
        return self.params(request, max_tokens, k)

    async def chat(self, request: ChatCompletionRequest, admission: Admission | None = None):
        model, ids, params, tools = await asyncio.to_thread(self.prepare_chat, request)  # as completion's
        self.check_capacity(1, admission)
        return await self.answer_chat(request, model, ids, params, tools)

    async def answer_chat(self, request: ChatCompletionRequest, model: str, ids: list[int], params,
                          tools: ToolChoice | None, turn: ChatTurn | None = None):
        """Run a prepared chat prompt: the JSON answer, or its SSE stream when asked for. A
        `turn` (a session's, /v1/sessions) names the session to the engine, hears the first
        choice's answer when it is complete, and adds its fields to the answer."""
        k = (request.top_logprobs or 0) if request.logprobs else None
        request_id = random_id("chatcmpl")
        if request.stream:
            return self._chat_stream(request, model, request_id, ids, params, tools, turn)
        samples, _, cached = await self._collect([ids], [params], request_id, request,
                                                 turn.session_id if turn else None)
        choices, completion_tokens = [], 0
        for j in range(request.n):
            sample = samples.get((0, j), _Sample())
            completion_tokens += len(sample.token_ids)
            message, finish_reason = _chat_message(sample, tools)
            choices.append({"index": j, "message": message,
                            "logprobs": self._chat_logprobs(sample.token_ids, sample.logprobs, k) if request.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": sample.stop_reason})
        answer = {"id": request_id, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
                  "usage": _usage(len(ids), completion_tokens, cached)}
        if turn is not None:
            turn.on_answer(samples.get((0, 0), _Sample()))
            answer.update(turn.fields)
        return answer

    async def _chat_stream(self, request, model, request_id, ids, params, tools: ToolChoice | None,
                           turn: ChatTurn | None = None):
        created = now()
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                **(turn.fields if turn else {})}
        completion_tokens = 0
        first = _Sample()  # the first choice, gathered for a session's history
        streams = {j: ToolCallStream(tools) for j in range(request.n)} if tools else {}
        try:
            for j in range(request.n):
                yield sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            cached = 0
            async for _, out in self.run_all([ids], [params], request_id, request.priority, request.cache_salt,
                                             turn.session_id if turn else None):
                cached = out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if turn is not None and c.index == 0:
                        first.add(c)
                    if not c.text and c.finish_reason is None:
                        continue
                    finish_reason = c.finish_reason
                    if tools:
                        stream = streams[c.index]
                        delta = stream.feed(c.text, finished=finish_reason is not None)
                        if stream.num_calls and finish_reason == "stop":
                            finish_reason = "tool_calls"
                        if not delta and finish_reason is None:
                            continue
                    else:
                        delta = {"content": c.text} if c.text else {}
                    yield sse({**head, "choices": [{
                        "index": c.index, "delta": delta,
                        "logprobs": self._chat_logprobs(c.token_ids, c.logprobs or [], params.logprobs) if request.logprobs else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason}]})
            if turn is not None:
                turn.on_answer(first)
            if request.stream_options and request.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(len(ids), completion_tokens, cached)})
        except OpenAIError as e:
            yield sse(e.body())
        yield sse("[DONE]")

    def _chat_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs], k: int) -> dict:
        return {"content": token_logprob_entries(token_ids, positions, k)}


def _decoded(tokenizer, ids) -> str:
    """A token-id prompt as text, for the content filter ("" for ids the tokenizer cannot decode:
    the engine refuses those)."""
    try:
        return tokenizer.decode(list(ids))
    except Exception:  # noqa: BLE001 - out-of-range ids: answered by the engine's own check
        return ""


def _subject(param: str) -> str:
    return "the messages have" if param == "messages" else f"the {param} has"


def _as_openai_error(error: BaseException, engine_healthy: bool) -> OpenAIError:
    """What a request's failure looks like to its client: 400 for bad input, 503 when the engine
    is gone or the server is stopping, else 500."""
    if isinstance(error, ValueError):
        return bad_value(error)
    if isinstance(error, EngineUnavailableError) or not engine_healthy:
        code = "shutting_down" if isinstance(error, ShuttingDownError) else "engine_unavailable"
        return OpenAIError(str(error), status=503, type_="server_error", code=code)
    return OpenAIError(str(error), status=500, type_="server_error")


@dataclass
class ChatTurn:
    """A session's turn through `Serving.answer_chat`: whose prefix the engine keeps, what to do
    with the answer (the first choice, complete), and fields the answer carries (session_id)."""

    session_id: str
    on_answer: Callable[["_Sample"], None]
    fields: dict = field(default_factory=dict)


@dataclass
class _Sample:
    """One choice gathered from its deltas; a choice that produced nothing counts as aborted."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = "abort"
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def _chat_message(sample: _Sample, tools: ToolChoice | None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice, with its tool calls parsed out."""
    if tools is None:
        return {"role": "assistant", "content": sample.text}, sample.finish_reason
    content, calls = tools.parse(sample.text)
    if not calls:
        return {"role": "assistant", "content": sample.text}, sample.finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
    return message, "tool_calls" if sample.finish_reason == "stop" else sample.finish_reason


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details={"cached_tokens": cached_tokens}).model_dump()


def token_logprob_entries(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> list[dict]:
    """Chat's per-token logprobs (OpenAI's `logprobs.content`; Ollama's `logprobs`): each token's
    text, logprob and UTF-8 bytes, with its top-k alternatives."""
    entries = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos[tid]
        tops = [{"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
                for _, lp in _top_k(pos, k)]
        entries.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                        "bytes": list(chosen.decoded_token.encode()), "top_logprobs": tops})
    return entries


def _top_k(position: PositionLogprobs, k: int):
    """The position's top-k alternatives (ranks 1..k), most likely first."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)


def _merge(a: dict, b: dict) -> dict:
    shift = (a["text_offset"][-1] + len(a["tokens"][-1])) if a["tokens"] else 0
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
            "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]]}
