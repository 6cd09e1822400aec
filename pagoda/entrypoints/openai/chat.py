"""/v1/chat/completions: messages through the chat template (tools rendered in) to an engine
request, and the engine's outputs to chat choices, streamed or whole, with tool calls parsed
out and logprobs; a session's turn (/v1/sessions) goes through the same path."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.entrypoints.openai.admission import Admission
from pagoda.entrypoints.openai.beam_requests import beam_search_params, beam_width, check_best_of
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.known_prefix import KnownPrefix
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, now, random_id
from pagoda.entrypoints.openai.response_parts import Sample, sse, token_logprob_entries, usage
from pagoda.entrypoints.openai.chat_images import content_text, images_in, message_content
from pagoda.entrypoints.openai.choice_parser import ChoiceParser, ParsedChoice
from pagoda.entrypoints.openai.tool_calls import ToolChoice, render_messages
from pagoda.outputs import PositionLogprobs
from pagoda.structured_output.grammar import validate_structured_outputs


class ChatServing:
    """Serving's chat (a part of `Serving`: the attributes are its own)."""

    def _chat_prompt(self, request: ChatCompletionRequest, tools: ToolChoice | None,
                     prefix: KnownPrefix | None = None) -> list[int]:
        messages = self.chat_messages(request.messages)
        self.check_input([content_text(m["content"]) for m in messages], "messages")
        template = self.tokenizer.chat_template or ""
        try:
            messages, extra = render_messages(messages, tools, template_takes_tools="tools" in template)
        except (ValueError, TypeError, KeyError) as e:
            raise OpenAIError(f"messages cannot be rendered with tools: {e!s}", param="messages") from None
        return self.encode_chat(messages, request.add_generation_prompt, prefix,
                                **{**extra, **(request.chat_template_kwargs or {})})

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
                message = {"role": m.role, "content": message_content(m, i, self.engine.input_processor.images)}
            except ValueError as e:
                raise OpenAIError(f"messages.{i}.content: {e}", param=f"messages.{i}.content") from None
            if m.tool_calls:
                message["tool_calls"] = [call.model_dump(exclude_unset=True) for call in m.tool_calls]
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        self.check_prompt_chars(sum(len(content_text(m["content"])) for m in out), "messages")
        return out

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool, prefix: KnownPrefix | None = None,
                    **template_kwargs) -> list[int]:
        """Render the chat template and tokenize (starting with `prefix`'s ids where the text
        extends it); a template that fails on the messages is a 400."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
            images = images_in(messages)
            if images:  # the model's image path places their tokens (the template wrote their markers)
                return self.engine.input_processor.images.from_text(text, images, add_special_tokens=False)
            return (prefix or KnownPrefix()).encode(self.tokenizer, text)
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        except Exception as e:  # jinja TemplateError from raise_exception in the template
            raise OpenAIError(f"chat template error: {e}", param="messages") from None

    def _tools(self, request: ChatCompletionRequest) -> ToolChoice | None:
        try:
            return ToolChoice.from_request(request.tools, request.tool_choice, request.parallel_tool_calls,
                                           self.tool_format)
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

    def prepare_chat(self, request: ChatCompletionRequest, prefix: KnownPrefix | None = None):
        """Check a chat request and make its engine input: (served model name, prompt token ids,
        sampling parameters, the tools it may call). Shared with the gRPC service, Anthropic's
        Messages and the Responses API (whose `previous_response_id` gives a known `prefix`)."""
        model = self.check_model(request.model)
        tools = self._tools(request)
        ids = self._chat_prompt(request, tools, prefix)
        params = self.chat_params(request, len(ids))
        self._constrain_to_tools(params, tools)
        if tools and tools.mode == "auto" and tools.fmt.keeps_special_tokens:
            params.skip_special_tokens = False  # the format's markers ([TOOL_CALLS]) are special tokens
        return model, ids, params, tools

    def chat_params(self, request: ChatCompletionRequest, prompt_len: int, prompt_param: str = "messages"):
        """A chat request's sampling parameters for a prompt of `prompt_len` tokens (top_logprobs
        and max_tokens checked; shared with /v1/sessions, whose prompt is its `content`)."""
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise OpenAIError(f"top_logprobs must be in [0, 20], got {request.top_logprobs}", param="top_logprobs")
        check_best_of(request)
        max_tokens = self.max_tokens_for(request.max_completion_tokens or request.max_tokens, prompt_len, prompt_param)
        if request.use_beam_search:
            return beam_search_params(request, max_tokens)
        k = (request.top_logprobs or 0) if request.logprobs else None
        return self.params(request, max_tokens, k)

    async def chat(self, request: ChatCompletionRequest, admission: Admission | None = None):
        model, ids, params, tools = await asyncio.to_thread(self.prepare_chat, request)  # as completion's
        self.check_capacity(beam_width(request), admission)  # a beam search runs its width
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
                                                 turn.session_id if turn else None, model)
        choices, completion_tokens, reasoning_tokens = [], 0, 0
        for j in range(request.n):
            sample = samples.get((0, j), Sample())
            completion_tokens += len(sample.token_ids)
            parsed = self.choice_parser(tools, ids, params.structured_outputs is not None).whole(sample.pieces)
            reasoning_tokens += parsed.reasoning_tokens
            message, finish_reason = _chat_message(parsed, sample.finish_reason)
            choices.append({"index": j, "message": message,
                            "logprobs": self._chat_logprobs(sample.token_ids, sample.logprobs, k) if request.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": sample.stop_reason})
        answer = {"id": request_id, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
                  "usage": usage(len(ids), completion_tokens, cached, reasoning_tokens if self.reasoning else None)}
        if turn is not None:
            turn.on_answer(samples.get((0, 0), Sample()))
            answer.update(turn.fields)
        return answer

    async def _chat_stream(self, request, model, request_id, ids, params, tools: ToolChoice | None,
                           turn: ChatTurn | None = None):
        created = now()
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                **(turn.fields if turn else {})}
        completion_tokens = 0
        first = Sample()  # the first choice, gathered for a session's history
        parsers = {j: self.choice_parser(tools, ids, params.structured_outputs is not None) for j in range(request.n)}
        try:
            for j in range(request.n):
                yield sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            cached = 0
            async for _, out in self.run_all([ids], [params], request_id, request.priority, request.cache_salt,
                                             turn.session_id if turn else None, model):
                cached = out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if turn is not None and c.index == 0:
                        first.add(c)
                    if not c.text and c.finish_reason is None:
                        continue
                    finish_reason = c.finish_reason
                    parser = parsers[c.index]
                    delta = parser.feed(c.text, len(c.token_ids), finished=finish_reason is not None)
                    if parser.num_calls and finish_reason == "stop":
                        finish_reason = "tool_calls"
                    if not delta and finish_reason is None:
                        continue
                    yield sse({**head, "choices": [{
                        "index": c.index, "delta": delta,
                        "logprobs": self._chat_logprobs(c.token_ids, c.logprobs or [], params.logprobs) if request.logprobs else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason}]})
            if turn is not None:
                turn.on_answer(first)
            if request.stream_options and request.stream_options.include_usage:
                reasoning = sum(p.reasoning_tokens for p in parsers.values()) if self.reasoning else None
                yield sse({**head, "choices": [], "usage": usage(len(ids), completion_tokens, cached, reasoning)})
        except OpenAIError as e:
            yield sse(e.body())
        yield sse("[DONE]")

    def choice_parser(self, tools: ToolChoice | None, ids: list[int], constrained: bool) -> ChoiceParser:
        """How one choice of this prompt is read: reasoning split off (--reasoning-parser; where
        the prompt ends, and whether a constraint shapes the output, decide whether it starts
        inside the reasoning), tool calls parsed."""
        if self.reasoning is None:
            return ChoiceParser(None, tools)
        tail = self.tokenizer.decode(ids[-8:], skip_special_tokens=False)
        return ChoiceParser(self.reasoning.splitter(tail, constrained), tools)

    def _chat_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs], k: int) -> dict:
        return {"content": token_logprob_entries(token_ids, positions, k)}


@dataclass
class ChatTurn:
    """A session's turn through `Serving.answer_chat`: whose prefix the engine keeps, what to do
    with the answer (the first choice, complete), and fields the answer carries (session_id)."""

    session_id: str
    on_answer: Callable[["Sample"], None]
    fields: dict = field(default_factory=dict)


def _chat_message(parsed: ParsedChoice, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice: its reasoning (with --reasoning-parser), its
    content, its tool calls."""
    message: dict = {"role": "assistant", "content": parsed.content}
    if parsed.split:
        message["reasoning_content"] = parsed.reasoning
    if not parsed.calls:
        return message, finish_reason
    message["tool_calls"] = [c.to_openai() for c in parsed.calls]
    return message, "tool_calls" if finish_reason == "stop" else finish_reason
