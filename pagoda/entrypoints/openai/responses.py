"""The OpenAI Responses API: `POST /v1/responses` (a response, or its stream of semantic events),
`GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

A response is a chat turn: its request is translated into a chat request
(responses_protocol.py) and goes through the chat path's checks, template and tools; its output
is built as items (responses_output.py). `previous_response_id` continues a stored response
(responses_store.py): the conversation through it comes before the new input, and the prompt
starts with the token ids the engine computed for it, whose KV the engine kept pinned."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Literal

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

from pagoda.entrypoints.openai.admission import Admission
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.known_prefix import KnownPrefix
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, describe_validation_errors, now
from pagoda.entrypoints.openai.respond import respond
from pagoda.entrypoints.openai.response_parts import Sample, cursor_page, dumps, token_logprob_entries
from pagoda.entrypoints.openai.responses_output import ResponseOutput, assistant_messages
from pagoda.entrypoints.openai.responses_protocol import (
    ResponsesRequest, chat_messages, chat_request, input_items, item_id,
)
from pagoda.entrypoints.openai.responses_store import (
    ResponseStore, StoredResponse, caller_tenant, response_pin_id,
)
from pagoda.entrypoints.openai.serving import Serving
from pagoda.entrypoints.openai.choice_parser import ChoiceParser, StreamedChoice
from pagoda.entrypoints.openai.tool_calls import ToolChoice

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    serving: Serving = request.app.state.serving
    run = partial(start_response, serving, request.app.state.responses)
    return await respond(serving, request.app.state.lifecycle, run, body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    return _store(request).get(response_id).body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request):
    """Stop a background response (its answer so far is dropped; it ends as cancelled)."""
    store = _store(request)
    response = store.get(response_id)
    if not response.body.get("background"):
        raise OpenAIError("Only background responses can be cancelled.", param="response_id")
    task = store.tasks.get(response_id)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return store.get(response_id).body


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc", after: str | None = None,
                           before: str | None = None):
    """This response's input items, a page at a time (OpenAI's cursor list: newest first unless
    `order=asc`, starting past the item `after`, stopping at the item `before`)."""
    items = list(reversed(_store(request).get(response_id).input_items))  # newest first
    return cursor_page(items, limit, order, after, before)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@dataclass
class _Turn:
    """One response being made: what it asked, what it continues, and its engine input."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    model: str
    ids: list[int]
    tools: ToolChoice | None
    items: list[dict]  # its input items
    previous: StoredResponse | None
    id: str
    created_at: int
    constrained: bool  # text.format or a tool_choice shapes the output

    def parser(self, serving: Serving) -> ChoiceParser:
        return serving.choice_parser(self.tools, self.ids, self.constrained)

    def response(self, output: list[dict], status: str, usage: dict | None) -> dict:
        """The response object (OpenAI's fields; what was asked, echoed)."""
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": body.background, "error": None, "incomplete_details": incomplete,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
                "output": output, "parallel_tool_calls": body.parallel_tool_calls,
                "previous_response_id": body.previous_response_id, "reasoning": body.reasoning or {"effort": None},
                "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
                "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "top_logprobs": body.top_logprobs, "truncation": body.truncation or "disabled", "usage": usage,
                "user": body.user, "metadata": body.metadata or {}}


async def start_response(serving: Serving, store: ResponseStore, body: ResponsesRequest,
                         admission: Admission | None):
    """Check and prepare the response, then run it: its event stream, or the response."""
    if body.background and (body.stream or not body.store):
        raise OpenAIError("a background response is stored and polled (GET /v1/responses/{id}): it takes store "
                          "true and no stream", param="background")
    previous = store.get(body.previous_response_id, "previous_response_id") if body.previous_response_id else None
    try:
        items = input_items(body)
        chat = chat_request(body, previous.history if previous else [])
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors())
        raise OpenAIError(message, param=param) from None
    except ValueError as e:
        name = re.match(r"[a-z_]+", str(e))
        raise OpenAIError(str(e), param=name.group(0) if name else None) from None
    prefix = previous.prefix if previous else None
    model, ids, params, tools = await asyncio.to_thread(serving.prepare_chat, chat, prefix)
    serving.check_capacity(1, admission)
    turn = _Turn(body, chat, model, ids, tools, items, previous, item_id("resp"), now(),
                 params.structured_outputs is not None)
    session = response_pin_id(caller_tenant(), turn.id) if body.store else None
    outputs = serving.run_all([ids], [params], turn.id, chat.priority, chat.cache_salt, session, chat.model)
    k = body.top_logprobs if body.top_logprobs else None
    if body.stream:
        return _events(serving, store, turn, outputs, k)
    if body.background:
        return _in_background(serving, store, turn, outputs, k)
    return await _answer(serving, store, turn, outputs, k)


def _in_background(serving: Serving, store: ResponseStore, turn: _Turn, outputs: AsyncIterator,
                   k: int | None) -> dict:
    """Store the response as in progress and make it in a task of its own; GET shows it as it
    stands, POST .../cancel stops it."""
    history = (turn.previous.history if turn.previous else []) + chat_messages(turn.items)
    placeholder = StoredResponse(turn.response([], "in_progress", None), turn.items, history, KnownPrefix())
    store.put(placeholder, None)

    async def run() -> None:
        try:
            await _answer(serving, store, turn, outputs, k)  # stores the finished response in its place
        except asyncio.CancelledError:
            store.finish(turn.id, "cancelled", None)
        except OpenAIError as e:
            store.finish(turn.id, "failed", {"code": e.code or "server_error", "message": e.message})
        else:
            store.finish(turn.id, "failed", {"code": "aborted", "message": "the response was aborted"})
        finally:
            store.tasks.pop(turn.id, None)

    store.tasks[turn.id] = asyncio.get_running_loop().create_task(run())
    return placeholder.body


def _status(sample: Sample) -> str:
    return "incomplete" if sample.finish_reason in ("length", "content_filter") else "completed"


def _usage(turn: _Turn, sample: Sample, cached: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": len(turn.ids), "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": len(sample.token_ids), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": len(turn.ids) + len(sample.token_ids)}


async def _answer(serving: Serving, store: ResponseStore, turn: _Turn, outputs: AsyncIterator,
                  k: int | None) -> dict:
    choice = StreamedChoice()
    sample, cached = await choice.gather(outputs), choice.cached
    parsed = turn.parser(serving).whole(sample.pieces)
    logprobs = token_logprob_entries(sample.token_ids, sample.logprobs, k) if k is not None else None
    output = ResponseOutput()
    status = _status(sample)
    output.add_whole(parsed.reasoning, parsed.content, parsed.calls, logprobs, status)
    response = turn.response(output.items, status, _usage(turn, sample, cached, parsed.reasoning_tokens))
    _keep(serving, store, turn, response, sample)
    return response


async def _events(serving: Serving, store: ResponseStore, turn: _Turn, outputs: AsyncIterator,
                  k: int | None) -> AsyncIterator[bytes]:
    """The semantic event stream: response.created and .in_progress, each item's events
    (responses_output.py), then response.completed or .incomplete; on failure an error event
    and response.failed."""
    sequence = iter(range(1 << 62))

    def event(data: dict) -> bytes:
        data = {**data, "sequence_number": next(sequence)}
        return b"event: " + data["type"].encode() + b"\ndata: " + dumps(data) + b"\n\n"

    yield event({"type": "response.created", "response": turn.response([], "in_progress", None)})
    yield event({"type": "response.in_progress", "response": turn.response([], "in_progress", None)})
    parser, output, choice = turn.parser(serving), ResponseOutput(), StreamedChoice()
    try:
        async for c, delta in choice.deltas(outputs, parser):
            logprobs = token_logprob_entries(c.token_ids, c.logprobs or [], k) if k is not None else None
            for data in output.feed(delta, logprobs):
                yield event(data)
        sample, cached = choice.sample, choice.cached
        status = _status(sample)
        for data in output.close(status):
            yield event(data)
        response = turn.response(output.items, status, _usage(turn, sample, cached, parser.reasoning_tokens))
        _keep(serving, store, turn, response, sample)
        yield event({"type": f"response.{status}", "response": response})
    except OpenAIError as e:
        yield event({"type": "error", "code": e.code, "message": e.message, "param": e.param})
        failed = turn.response(output.items, "failed", None)
        failed["error"] = {"code": e.code or "server_error", "message": e.message}
        yield event({"type": "response.failed", "response": failed})


def _keep(serving: Serving, store: ResponseStore, turn: _Turn, response: dict, sample: Sample) -> None:
    """Store a finished response (`store`, the default) with the conversation through it."""
    if not turn.body.store or sample.finish_reason in (None, "abort"):
        return
    history = (turn.previous.history if turn.previous else []) + chat_messages(turn.items)
    stored = StoredResponse(response, turn.items, history + assistant_messages(response["output"]),
                            KnownPrefix.of(serving.tokenizer, turn.ids, sample.token_ids), pinned=True)
    store.put(stored, turn.previous)
