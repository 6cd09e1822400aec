"""One Batch API file's lines: read and checked (`parse_lines`), each run on the served model the
way its route would answer it (`run_line`), and its answer written as OpenAI's output line.
Shared by the server's batches (batch_runner.py) and `pagoda run-batch` (run_batch.py).

Batch work runs at `BATCH_PRIORITY`, far below any interactive request, as background work: it
fills the engine's idle capacity, sits out every step in which an interactive prompt is computed
(so that prompt's first token waits for no batch decode), and an interactive arrival that finds
no room preempts it (core/scheduler.py).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import orjson
from pydantic import ValidationError

from pagoda.core.request_order import BACKGROUND_PRIORITY
from pagoda.entrypoints.openai.errors import OpenAIError, bad_value
from pagoda.entrypoints.openai.pooling_protocol import EmbeddingRequest
from pagoda.entrypoints.openai.pooling_routes import embed_answer
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, describe_validation_errors
from pagoda.entrypoints.openai.responses import start_response
from pagoda.entrypoints.openai.responses_protocol import ResponsesRequest
from pagoda.entrypoints.openai.responses_store import ResponseStore
from pagoda.entrypoints.openai.serving import Serving

# Background work for the scheduler (core/request_order.py): it yields any step in which an
# interactive prompt is computed, and ranks below interactive work for 1000 × the aging period.
BATCH_PRIORITY = BACKGROUND_PRIORITY


@dataclass
class BatchLine:
    number: int  # from 1, as OpenAI counts lines in errors
    custom_id: str
    url: str
    body: dict


Handler = Callable[[Serving, ResponseStore, dict], Awaitable[dict]]


async def _chat(serving: Serving, store: ResponseStore, body: dict) -> dict:
    return await serving.chat(ChatCompletionRequest.model_validate(body))


async def _completion(serving: Serving, store: ResponseStore, body: dict) -> dict:
    return await serving.completion(CompletionRequest.model_validate(body))


async def _response(serving: Serving, store: ResponseStore, body: dict) -> dict:
    return await start_response(serving, store, ResponsesRequest.model_validate(body), None)


async def _embedding(serving: Serving, store: ResponseStore, body: dict) -> dict:
    return await embed_answer(serving, EmbeddingRequest.model_validate(body))


# the routes a batch may call (OpenAI's `endpoint`), and how each line runs
ENDPOINTS: dict[str, Handler] = {"/v1/chat/completions": _chat, "/v1/completions": _completion,
                                 "/v1/responses": _response, "/v1/embeddings": _embedding}


def parse_lines(content: bytes, endpoint: str | None) -> tuple[list[BatchLine], list[dict]]:
    """The file's requests, and OpenAI's validation errors ({code, message, param, line}). Every
    line calls `endpoint` (a batch job's), or any of ENDPOINTS (None: `pagoda run-batch`)."""
    lines, errors, seen = [], [], set()

    def error(code: str, message: str, number: int, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": number})

    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError:
            error("invalid_json_line", f"line {number} is not JSON", number)
            continue
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str) \
                or not isinstance(item.get("body"), dict):
            error("missing_required_parameter", f"line {number} needs custom_id (a string) and body (an object)",
                  number, "custom_id" if not isinstance(item, dict) or "custom_id" not in item else "body")
            continue
        if item.get("method", "POST") != "POST":
            error("invalid_method", f"line {number}: method must be POST", number, "method")
        elif item.get("url") != endpoint if endpoint is not None else item.get("url") not in ENDPOINTS:
            wanted = f"the batch's endpoint {endpoint}" if endpoint else f"one of {', '.join(ENDPOINTS)}"
            error("invalid_url", f"line {number}: url {item.get('url')!r} is not {wanted}", number, "url")
        elif item["custom_id"] in seen:
            error("duplicate_custom_id", f"line {number}: custom_id {item['custom_id']!r} is used twice", number,
                  "custom_id")
        else:
            seen.add(item["custom_id"])
            lines.append(BatchLine(number, item["custom_id"], item["url"], item["body"]))
    if not lines and not errors:
        error("empty_file", "the file has no requests", 0)
    return lines, errors


async def run_line(serving: Serving, store: ResponseStore, line: BatchLine) -> tuple[int, dict]:
    """(HTTP status, body) of one request, as its route would answer it, at batch priority."""
    body = {**line.body, "stream": False, "priority": BATCH_PRIORITY + int(line.body.get("priority") or 0)}
    try:
        return 200, await ENDPOINTS[line.url](serving, store, body)
    except OpenAIError as e:
        return e.status, e.body()
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors())
        return 400, OpenAIError(message, param=param).body()
    except ValueError as e:
        return 400, bad_value(e).body()


def output_line(line: BatchLine, status: int, body: dict) -> dict:
    """OpenAI's line of the output (200) or error file: the answer under `response`."""
    request_id = body.get("id") if status == 200 else None
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id or f"req_{secrets.token_hex(12)}",
                         "body": body}, "error": None}


def jsonl(items: list[Any]) -> bytes:
    return b"".join(orjson.dumps(item) + b"\n" for item in items)
