"""`/api/generate` and `/api/chat` on the served model: `options` and `format` to SamplingParams,
the prompts (prompts.py), NDJSON streaming with Ollama's timing fields. A request's prompt and
sampling parameters are made off the event loop: rendering a template, tokenizing and building a
`format` schema's grammar take time in proportion to what the request sends."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagoda.entrypoints.disconnect import GONE, unless_disconnected
from pagoda.entrypoints.ollama.common import (
    DEFAULTS,
    FLOAT_OPTIONS,
    IGNORED_OPTIONS,
    INT_OPTIONS,
    NDJSON,
    ChatBody,
    GenerateBase,
    GenerateBody,
    OllamaError,
    as_ollama_error,
    json_response,
    ndjson_line,
    now_iso,
    ollama_errors,
    read_body,
)
from pagoda.entrypoints.ollama.prompts import chat_prompt, generate_prompt
from pagoda.entrypoints.openai.lifecycle import check_serving
from pagoda.entrypoints.openai.middleware import ReleasingStream
from pagoda.entrypoints.openai.protocol import random_id
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.response_parts import token_logprob_entries
from pagoda.entrypoints.openai.serving import Serving
from pagoda.entrypoints.openai.choice_parser import ChoiceParser
from pagoda.entrypoints.openai.tool_calls import ToolChoice
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.security.context import request_context
from pagoda.structured_output.grammar import validate_structured_outputs

logger = logging.getLogger("pagoda.ollama")
router = APIRouter()


# -- the served model -------------------------------------------------------------------------
def serving_of(request: Request) -> Serving:
    return request.app.state.serving


def served_name(serving: Serving, model: str) -> str:
    """The served name for a request's `model` (`name` or `name:latest`), else a 404."""
    if not model:
        raise OllamaError("model is required")
    ctx = request_context()  # --auth-config: the key's role may use this name (else 403)
    for candidate in (model, model.removesuffix(":latest")):
        adapter = serving.adapters is not None and serving.adapters.get(candidate) is not None  # a LoRA adapter's
        if candidate in serving.accepted_names or adapter:
            if ctx is not None:
                ctx.check_model(candidate)
            return candidate if adapter else serving.model_names[0]
    served = ", ".join(repr(n) for n in (ctx.visible(serving.model_names) if ctx is not None else serving.model_names))
    raise OllamaError(f"model {model!r} not found: this server runs {served} (one model per server; start "
                      f"`pagoda serve --model {model}` to run it)", 404)


def store_visible() -> bool:
    """--auth-config: only an `admin` role sees the model store beyond the served model (its
    write routes are refused earlier, in pagoda/security/access.py)."""
    ctx = request_context()
    return ctx is None or ctx.grant is None or ctx.grant.role.admin


def visible_names(names: list[str]) -> list[str]:
    ctx = request_context()
    return ctx.visible(names) if ctx is not None else names


def _check_alive(request: Request) -> None:
    try:
        check_serving(request.app.state.lifecycle, serving_of(request).engine)
        serving_of(request).check_runner("generate")  # an embedding model generates nothing: 400
    except OpenAIError as e:
        raise as_ollama_error(e) from None


def _option(options: dict, name: str):
    value = options.get(name)
    if value is None:
        return None
    if name in FLOAT_OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise OllamaError(f"options.{name} must be a number, got {value!r}")
    if name in INT_OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value)):
        raise OllamaError(f"options.{name} must be an integer, got {value!r}")
    return int(value) if name in INT_OPTIONS else float(value)


def _structured(fmt: str | dict | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return StructuredOutputsParams(json_object=True)
    if isinstance(fmt, dict):
        params = StructuredOutputsParams(json=fmt)
        try:
            validate_structured_outputs(params, "format")
        except ValueError as e:
            raise OllamaError(f"format: {e}") from None
        return params
    raise OllamaError(f'format must be "json" or a JSON schema object, got {fmt!r}')


_OLLAMA_NAMES = {"repetition_penalty": "repeat_penalty"}  # SamplingParams field → Ollama option, where they differ


def sampling_params(serving: Serving, body: GenerateBase, prompt_len: int) -> SamplingParams:
    """`options` and `format` → SamplingParams (Ollama's defaults for what is not given)."""
    options = dict(body.options or {})
    unknown = set(options) - IGNORED_OPTIONS - FLOAT_OPTIONS - INT_OPTIONS - {"stop"}
    if unknown:
        logger.warning("ignoring unknown options %s", sorted(unknown))
    values = {name: _option(options, name) for name in FLOAT_OPTIONS | INT_OPTIONS}
    stop = options.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise OllamaError("options.stop must be a list of strings")
    room = serving.max_model_len - prompt_len
    if room < 1:
        raise OllamaError(f"the prompt has {prompt_len} tokens, which leaves no room to generate in this model's "
                          f"context of {serving.max_model_len} tokens")
    num_predict = values["num_predict"]
    # -1 (Ollama's default) and -2: until the end or the context is full; more than the room
    # left is cut at the context's end, as Ollama does, rather than refused.
    if num_predict is None:  # the model's PARAMETER num_predict, if it has one
        num_predict = serving.sampling_defaults.get("max_tokens")
    max_tokens = room if num_predict is None or num_predict <= 0 else min(num_predict, room)
    model_defaults = {_OLLAMA_NAMES.get(k, k): v for k, v in serving.sampling_defaults.items()}

    def pick(name, default):  # the request's option, else the model's PARAMETER, else Ollama's default
        return model_defaults.get(name, default) if values[name] is None else values[name]

    try:
        return SamplingParams(
            temperature=pick("temperature", DEFAULTS["temperature"]), top_p=pick("top_p", DEFAULTS["top_p"]),
            top_k=pick("top_k", DEFAULTS["top_k"]), min_p=pick("min_p", DEFAULTS["min_p"]),
            repetition_penalty=pick("repeat_penalty", 1.0), presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0), seed=pick("seed", None), max_tokens=max_tokens,
            stop=stop or None, structured_outputs=_structured(body.format), logprobs=_logprobs_k(body),
            # a tool-call format whose markers are special tokens ([TOOL_CALLS]) needs them in the text
            skip_special_tokens=not (getattr(body, "tools", None) and serving.tool_format.keeps_special_tokens))
    except ValueError as e:
        raise OllamaError(f"options: {e}") from None


MAX_TOP_LOGPROBS = 20  # as Ollama (and OpenAI's chat) allow


def _refuse_unsupported(body: GenerateBase, serving: Serving) -> None:
    if body.think not in (None, False, "") and serving.reasoning is None:
        raise OllamaError("this model does not support thinking (`think`): the server splits a thinking model's "
                          "reasoning when started with --reasoning-parser")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise OllamaError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {body.top_logprobs}")


def _logprobs_k(body: GenerateBase) -> int | None:
    """The top alternatives per token when `logprobs` (or `top_logprobs`) is asked for, else None."""
    if not body.logprobs and not body.top_logprobs:
        return None
    return body.top_logprobs or 0


def _tools(body: ChatBody, serving: Serving) -> ToolChoice | None:
    """The request's `tools` (OpenAI's function schema, as Ollama takes them): the model may call
    them (tool_choice "auto"); a malformed tool is a 400 naming it."""
    try:
        return ToolChoice.from_request(body.tools, None, parallel=True, fmt=serving.tool_format)
    except ValueError as e:
        raise OllamaError(str(e)) from None


class _ChatReply:
    """The assistant's message, piece by piece: with --reasoning-parser, the model's reasoning as
    `thinking`; with tools, the model's `<tool_call>` blocks become Ollama's `tool_calls`
    (arguments as objects) as each one closes, and never show as text."""

    def __init__(self, parser: ChoiceParser) -> None:
        self.parser = parser

    def __call__(self, text: str, finished: bool) -> dict | None:
        delta = self.parser.feed(text, 0, finished)
        message = {"role": "assistant", "content": delta.get("content", "")}
        if delta.get("reasoning_content"):
            message["thinking"] = delta["reasoning_content"]
        if delta.get("tool_calls"):
            message["tool_calls"] = [{"function": {"index": call["index"], "name": call["function"]["name"],
                                                   "arguments": _arguments(call["function"]["arguments"])}}
                                     for call in delta["tool_calls"]]
        return {"message": message} if len(message) > 2 or message["content"] or finished else None


class _GenerateReply:
    """/api/generate's `response` piece by piece, and its `thinking` with --reasoning-parser."""

    def __init__(self, parser: ChoiceParser) -> None:
        self.parser = parser

    def __call__(self, text: str, finished: bool) -> dict | None:
        delta = self.parser.feed(text, 0, finished)
        fields = {"response": delta.get("content", "")}
        if delta.get("reasoning_content"):
            fields["thinking"] = delta["reasoning_content"]
        return fields if len(fields) > 1 or fields["response"] or finished else None


def _arguments(text: str) -> dict:
    """A call's JSON arguments as the object Ollama sends ({} for what does not parse as one)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class _Timing:
    """Ollama's durations, in nanoseconds."""

    def __init__(self, prompt_len: int) -> None:
        self.start = time.perf_counter_ns()
        self.first: int | None = None
        self.prompt_len = prompt_len
        self.generated = 0

    def saw(self, n_tokens: int) -> None:
        if self.first is None and n_tokens:
            self.first = time.perf_counter_ns()
        self.generated += n_tokens

    def fields(self, done_reason: str | None) -> dict:
        end = time.perf_counter_ns()
        first = self.first or end
        return {"done": True, "done_reason": done_reason, "total_duration": end - self.start, "load_duration": 0,
                "prompt_eval_count": self.prompt_len, "prompt_eval_duration": first - self.start,
                "eval_count": self.generated, "eval_duration": end - first}


def _done_reason(finish_reason: str | None) -> str:
    return {"stop": "stop", "length": "length"}.get(finish_reason or "", finish_reason or "abort")


async def _run(request: Request, body: GenerateBase, ids: list[int], model: str,
               shape: Callable[[str, bool], dict | None], final_extra: Callable[[list[int]], dict]) -> Response:
    """Run one prompt; stream NDJSON lines or answer one object. `shape(text, finished)` gives a
    line's fields for the text generated since the last one (None: no line yet)."""
    serving = serving_of(request)
    params = await asyncio.to_thread(sampling_params, serving, body, len(ids))
    k = params.logprobs
    admission = serving.admission()
    try:
        serving.check_capacity(1, admission)
        request_id = random_id("ollama")

        async def results() -> AsyncIterator[tuple[str, list[int], str | None, list[dict]]]:
            async for _, out in serving.run_all([ids], [params], request_id, 0, model=model):
                c = out.outputs[0]
                token_ids = list(c.token_ids)
                logprobs = token_logprob_entries(token_ids, c.logprobs or [], k) if k is not None else []
                yield c.text, token_ids, c.finish_reason, logprobs

        timing = _Timing(len(ids))
        if body.stream:
            async def lines() -> AsyncIterator[bytes]:
                generated: list[int] = []
                reason, pending = None, []  # logprobs of tokens whose text no line has carried yet
                try:
                    async for text, token_ids, reason, logprobs in results():
                        timing.saw(len(token_ids))
                        generated += token_ids
                        pending += logprobs
                        fields = shape(text, False) if text else None
                        if fields is not None:
                            yield ndjson_line({"model": model, "created_at": now_iso(), **fields,
                                               **_logprobs_field(k, pending), "done": False})
                            pending = []
                    yield ndjson_line({"model": model, "created_at": now_iso(), **(shape("", True) or {}),
                                       **_logprobs_field(k, pending), **timing.fields(_done_reason(reason)),
                                       **final_extra(generated)})
                except OpenAIError as e:
                    yield ndjson_line({"error": e.message})

            response = ReleasingStream(lines(), admission.release, media_type=NDJSON)
            admission = None
            return response

        async def collect() -> dict:
            text, generated, reason, all_logprobs = "", [], None, []
            async for piece, token_ids, reason, logprobs in results():
                timing.saw(len(token_ids))
                text += piece
                generated += token_ids
                all_logprobs += logprobs
            return {"model": model, "created_at": now_iso(), **(shape(text, True) or {}),
                    **_logprobs_field(k, all_logprobs), **timing.fields(_done_reason(reason)), **final_extra(generated)}

        result = await unless_disconnected(request, collect())
        return json_response(result) if result is not GONE else Response(status_code=499)
    finally:
        if admission is not None:
            admission.release()


def _logprobs_field(k: int | None, entries: list[dict]) -> dict:
    """Ollama's `logprobs` (token, logprob, bytes, top_logprobs) when the request asked for them."""
    return {"logprobs": entries} if k is not None else {}


async def _generation_request(request: Request, kind: type[GenerateBase]):
    """/api/generate's or /api/chat's body, the serving and the served name, once the body,
    the model and the engine's health pass and nothing unsupported is asked for."""
    body = await read_body(request, kind)
    serving = serving_of(request)
    model = served_name(serving, body.model)
    _check_alive(request)
    _refuse_unsupported(body, serving)
    return body, serving, model


@router.post("/api/generate")
@ollama_errors
async def generate(request: Request):
    body, serving, model = await _generation_request(request, GenerateBody)
    if body.suffix:
        raise OllamaError("suffix (fill-in-the-middle) is not supported")
    if not body.prompt and not body.context:
        # Ollama's "load the model" request: the model is always loaded here.
        return json_response({"model": model, "created_at": now_iso(), "response": "", "done": True,
                              "done_reason": "load"})
    ids = await asyncio.to_thread(generate_prompt, serving, body)
    extra = (lambda generated: {}) if body.raw else (lambda generated: {"context": ids + generated})
    reply = _GenerateReply(serving.choice_parser(None, ids, constrained=bool(body.format)))
    return await _run(request, body, ids, model, reply, extra)


@router.post("/api/chat")
@ollama_errors
async def chat(request: Request):
    body, serving, model = await _generation_request(request, ChatBody)
    if not body.messages:
        return json_response({"model": model, "created_at": now_iso(), "message": {"role": "assistant", "content": ""},
                              "done": True, "done_reason": "load"})
    tools = _tools(body, serving)
    ids = await asyncio.to_thread(chat_prompt, serving, body, tools)
    reply = _ChatReply(serving.choice_parser(tools, ids, constrained=bool(body.format)))
    return await _run(request, body, ids, model, reply, lambda generated: {})
