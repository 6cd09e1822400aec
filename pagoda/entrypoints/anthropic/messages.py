"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API on the chat path
(entrypoints/openai/chat.py's checks, template and tools), its answer as content blocks, its
stream as Anthropic's events, its errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from functools import partial, wraps
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pagoda.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, chat_request
from pagoda.entrypoints.input_limits import parse_json_object
from pagoda.entrypoints.openai.admission import Admission
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import describe_validation_errors
from pagoda.entrypoints.openai.respond import respond
from pagoda.entrypoints.openai.response_parts import Sample
from pagoda.entrypoints.openai.serving import Serving
from pagoda.entrypoints.openai.choice_parser import ChoiceParser, StreamedChoice

router = APIRouter()

# HTTP status → Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error"}


def _error_body(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_errors(handler: Callable):
    """Anthropic's error body for what a handler raises that is the client's fault or a limit."""

    @wraps(handler)
    async def wrapped(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except OpenAIError as e:
            return JSONResponse(_error_body(e.message, e.status), status_code=e.status, headers=e.headers)
        except ValidationError as e:
            message, _ = describe_validation_errors(e.errors())
            return JSONResponse(_error_body(message, 400), status_code=400)
        except ValueError as e:
            return JSONResponse(_error_body(str(e), 400), status_code=400)

    return wrapped


async def _read(request: Request, kind):
    return kind.model_validate(parse_json_object(await request.body()))


@router.post("/v1/messages/count_tokens")
@anthropic_errors
async def count_tokens(request: Request):
    body = await _read(request, CountTokensRequest)
    serving: Serving = request.app.state.serving
    _, ids, _, _ = await asyncio.to_thread(serving.prepare_chat, chat_request(body))
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
@anthropic_errors
async def create_message(request: Request):
    body = await _read(request, MessagesRequest)
    serving: Serving = request.app.state.serving
    return await respond(serving, request.app.state.lifecycle, partial(_message, serving), body, request)


async def _message(serving: Serving, body: MessagesRequest, admission: Admission):
    """The message's event stream when it streams, else the message."""
    chat = chat_request(body)
    model, ids, params, tools = await asyncio.to_thread(serving.prepare_chat, chat)
    serving.check_capacity(1, admission)
    message_id = "msg_" + secrets.token_hex(12)
    outputs = serving.run_all([ids], [params], message_id, chat.priority, chat.cache_salt, model=chat.model)
    parser = serving.choice_parser(tools, ids, params.structured_outputs is not None)
    if body.stream:
        return _events(message_id, model, outputs, parser, len(ids))
    return await _answer(message_id, model, outputs, parser, len(ids))


def _stop_reason(sample: Sample, called: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence)."""
    if called:
        return "tool_use", None
    if sample.finish_reason == "length":
        return "max_tokens", None
    if sample.finish_reason == "content_filter":
        return "refusal", None
    if isinstance(sample.stop_reason, str):
        return "stop_sequence", sample.stop_reason
    return "end_turn", None


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}


def _tool_use(call_id: str, name: str, arguments: str) -> dict:
    try:
        arguments_value = json.loads(arguments) if arguments else {}
    except ValueError:
        arguments_value = {"arguments": arguments}
    return {"type": "tool_use", "id": "toolu_" + call_id.removeprefix("call_"), "name": name,
            "input": arguments_value if isinstance(arguments_value, dict) else {"value": arguments_value}}


async def _answer(message_id: str, model: str, outputs: AsyncIterator, parser: ChoiceParser,
                  prompt_tokens: int) -> dict:
    choice = StreamedChoice()
    sample, cached = await choice.gather(outputs), choice.cached
    parsed = parser.whole(sample.pieces)
    content: list[dict] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    content += [_tool_use(c.id, c.name, c.arguments) for c in parsed.calls]
    stop_reason, stop_sequence = _stop_reason(sample, bool(parsed.calls))
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(prompt_tokens, cached, len(sample.token_ids))}


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


class _Blocks:
    """The stream's content blocks: a thinking, text or tool_use block open at a time."""

    def __init__(self) -> None:
        self.index, self.open = -1, None  # None, "thinking", "text" or "tool_use"

    def start(self, block: dict) -> list[bytes]:
        events = self.stop()
        self.index, self.open = self.index + 1, block["type"]
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


async def _events(message_id: str, model: str, outputs: AsyncIterator, parser: ChoiceParser,
                  prompt_tokens: int) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: message_start, per block content_block_start / _delta / _stop,
    message_delta (stop reason, output tokens), message_stop; an error event if the run fails."""
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_tokens, 0, 0)}})
    blocks, choice = _Blocks(), StreamedChoice()
    try:
        async for _, delta in choice.deltas(outputs, parser):
            if delta.get("reasoning_content"):
                if blocks.open != "thinking":
                    for event in blocks.start({"type": "thinking", "thinking": "", "signature": ""}):
                        yield event
                yield blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                if blocks.open != "text":
                    for event in blocks.start({"type": "text", "text": ""}):
                        yield event
                yield blocks.delta({"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls", ()):
                function = call.get("function", {})
                if call.get("id"):
                    for event in blocks.start({**_tool_use(call["id"], function.get("name", ""), ""), "input": {}}):
                        yield event
                if function.get("arguments"):
                    yield blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        for event in blocks.stop():
            yield event
        stop_reason, stop_sequence = _stop_reason(choice.sample, bool(parser.num_calls))
        yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": len(choice.sample.token_ids),
                                                 "cache_read_input_tokens": choice.cached}})
        yield _event("message_stop", {})
    except OpenAIError as e:
        yield _event("error", {"error": _error_body(e.message, e.status)["error"]})
