"""`/v1/batches`: OpenAI's Batch API. A job names an uploaded JSONL file (`/v1/files`) and the
route its lines call; the server runs it in the background at batch priority (batch_runner.py)
and writes the answers to an output file and the failures to an error file. Jobs are records in
the state database: a restarted server resumes them. With `--auth-config` a job is its tenant's
own and runs under the key that created it."""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field

from pagoda.entrypoints.openai.batch_lines import ENDPOINTS
from pagoda.entrypoints.openai.batch_runner import BatchRunner
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.files import FileStore
from pagoda.entrypoints.openai.protocol import RequestBody
from pagoda.entrypoints.openai.response_parts import cursor_page
from pagoda.entrypoints.openai.responses_store import caller_tenant
from pagoda.security.context import request_context

router = APIRouter()
WINDOW_SECONDS = {"24h": 24 * 3600}


class BatchRequest(RequestBody):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def _runner(request: Request) -> BatchRunner:
    return request.app.state.batches


@router.post("/v1/batches")
async def create_batch(body: BatchRequest, request: Request):
    runner = _runner(request)
    if body.endpoint not in ENDPOINTS:
        raise OpenAIError(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {body.endpoint!r}", param="endpoint")
    if body.completion_window not in WINDOW_SECONDS:
        raise OpenAIError("completion_window must be '24h'", param="completion_window")
    tenant = caller_tenant()
    file = _input_file(runner.files, body.input_file_id, tenant)
    now = int(time.time())
    ctx = request_context()
    batch: dict[str, Any] = {
        "id": f"batch_{secrets.token_hex(12)}", "object": "batch", "endpoint": body.endpoint, "errors": None,
        "input_file_id": file["id"], "completion_window": body.completion_window, "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
        "expires_at": now + WINDOW_SECONDS[body.completion_window], "finalizing_at": None, "completed_at": None,
        "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.metadata,
        # who runs it (--auth-config): the key that created it, looked up again when it runs
        "key_id": ctx.grant.key.id if ctx is not None and ctx.grant is not None else None}
    runner.db.put("batch", tenant, batch["id"], batch, now)
    runner.submit(tenant, batch["id"])
    return _public(batch)


def _input_file(files: FileStore, file_id: str, tenant: str | None) -> dict:
    try:
        file = files.get(file_id, tenant)
    except OpenAIError as e:
        raise OpenAIError(e.message, status=404, param="input_file_id", code="file_not_found") from None
    if file["purpose"] != "batch":
        raise OpenAIError(f"file {file_id} was uploaded for {file['purpose']!r}, not 'batch'", param="input_file_id")
    return file


def _public(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "key_id"}


def _get(request: Request, batch_id: str) -> dict:
    batch = _runner(request).db.get("batch", caller_tenant(), batch_id)
    if batch is None:
        raise OpenAIError(f"No batch found with id {batch_id!r}", status=404, param="batch_id",
                          code="batch_not_found")
    return batch


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request):
    return _public(_get(request, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request):
    batch = _get(request, batch_id)
    if batch["status"] in ("cancelling", "cancelled"):
        return _public(batch)
    if batch["status"] not in ("validating", "in_progress"):
        raise OpenAIError(f"batch {batch_id} is {batch['status']}: only a batch in progress can be cancelled",
                          status=409, type_="conflict_error", code="batch_not_cancellable")
    batch.update(status="cancelling", cancelling_at=int(time.time()))
    _runner(request).db.put("batch", caller_tenant(), batch_id, batch, batch["created_at"])
    return _public(batch)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None,
                       order: Literal["asc", "desc"] = "desc"):
    batches = [_public(b) for b in _runner(request).db.listing("batch", caller_tenant())]
    return cursor_page(batches, limit, order, after)
