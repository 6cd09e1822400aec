"""`/v1/files`: OpenAI's file store, as far as the Batch API needs it: upload (a batch's JSONL
input), list, retrieve, the content, delete. The server writes its batches' output and error
files here too. Metadata is a record in the state database, the bytes a file beside it
(state_db.py); with `--auth-config` a file is its tenant's own."""

from __future__ import annotations

import os
import secrets
import time
from typing import Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.response_parts import cursor_page
from pagoda.entrypoints.openai.responses_store import caller_tenant
from pagoda.entrypoints.state_db import StateDB

PURPOSES = ("batch", "batch_output", "user_data", "assistants", "fine-tune", "vision", "evals")
router = APIRouter()


class FileStore:
    def __init__(self, db: StateDB) -> None:
        self.db = db

    def add(self, content: bytes, filename: str, purpose: str, tenant: str | None) -> dict:
        file = {"id": f"file-{secrets.token_hex(12)}", "object": "file", "bytes": len(content),
                "created_at": int(time.time()), "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": None, "status_details": None}
        path = self.db.files_dir / file["id"]
        partial = path.with_suffix(".partial")
        partial.write_bytes(content)
        os.replace(partial, path)  # a crash leaves no half-written file under the id
        self.db.put("file", tenant, file["id"], file, time.time())
        return file

    def get(self, file_id: str, tenant: str | None) -> dict:
        file = self.db.get("file", tenant, file_id)
        if file is None:
            raise OpenAIError(f"No such File object: {file_id}", status=404, type_="invalid_request_error",
                              param="file_id", code="file_not_found")
        return file

    def content(self, file_id: str, tenant: str | None) -> bytes:
        self.get(file_id, tenant)
        return (self.db.files_dir / file_id).read_bytes()

    def delete(self, file_id: str, tenant: str | None) -> None:
        self.get(file_id, tenant)
        self.db.delete("file", tenant, file_id)
        (self.db.files_dir / file_id).unlink(missing_ok=True)

    def listing(self, tenant: str | None) -> list[dict]:
        return self.db.listing("file", tenant)


def _files(request: Request) -> FileStore:
    return request.app.state.files


@router.post("/v1/files")
async def upload(request: Request, file: UploadFile = File(...), purpose: str = Form(...)):
    if purpose not in PURPOSES:
        raise OpenAIError(f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}", param="purpose")
    content = await file.read()
    if purpose == "batch" and not content.strip():
        raise OpenAIError("the file is empty: a batch file has one JSON request per line", param="file")
    return _files(request).add(content, file.filename or "upload", purpose, caller_tenant())


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                     order: Literal["asc", "desc"] = "desc", after: str | None = None):
    files = [f for f in _files(request).listing(caller_tenant()) if purpose is None or f["purpose"] == purpose]
    return cursor_page(files, limit, order, after)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request):
    return _files(request).get(file_id, caller_tenant())


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request):
    return Response(_files(request).content(file_id, caller_tenant()), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request):
    _files(request).delete(file_id, caller_tenant())
    return {"id": file_id, "object": "file", "deleted": True}
