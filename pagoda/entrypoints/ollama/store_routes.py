"""The model store through Ollama's API: `/api/pull`, `/api/push`, `/api/delete`, `/api/copy`,
`/api/blobs` and `/api/create`, each calling pagoda/store on a thread."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from pagoda.entrypoints.ollama.common import (
    NDJSON,
    CopyBody,
    CreateBody,
    ModelBody,
    OllamaError,
    as_ollama_error,
    json_response,
    ndjson_line,
    ollama_errors,
    read_body,
)

logger = logging.getLogger("pagoda.ollama")
router = APIRouter()


# -- the store --------------------------------------------------------------------------------
async def _status_response(work: Callable[[], list[dict]], first: list[dict], stream: bool) -> Response:
    """Run blocking store `work` on a thread. Streamed: Ollama's status lines (`first`, what
    `work` returns, then success; a failure is an `{"error"}` line). Else one `{"status":
    "success"}`, or the error with its status code."""
    if not stream:
        await asyncio.to_thread(work)
        return json_response({"status": "success"})

    async def lines():
        for line in first:
            yield ndjson_line(line)
        try:
            for line in await asyncio.to_thread(work):
                yield ndjson_line(line)
        except Exception as e:  # noqa: BLE001 - reported on the stream, as Ollama does
            try:
                err = as_ollama_error(e)
            except Exception:
                logger.exception("store operation failed")
                err = OllamaError(f"internal error: {type(e).__name__}", 500)
            yield ndjson_line({"error": err.message})
            return
        yield ndjson_line({"status": "success"})

    return StreamingResponse(lines(), media_type=NDJSON)


def _layer_lines(manifest, verb: str) -> list[dict]:
    return [{"status": f"{verb} {layer.digest.removeprefix('sha256:')[:12]}", "digest": layer.digest,
             "total": layer.size, "completed": layer.size} for layer in manifest.blobs()]


@router.post("/api/pull")
@ollama_errors
async def pull(request: Request):
    body: ModelBody = await read_body(request, ModelBody)
    name = body.ref

    def work() -> list[dict]:
        from pagoda.store import create, manifests, registry
        from pagoda.store.layout import default_layout, parse_ref

        layout = default_layout()
        entry = create.catalog_entry_for(name)
        if entry is not None:
            ref, manifest = create.record_catalog_model(layout, entry.name)
        else:
            ref = parse_ref(name)
            registry.pull(layout, ref, insecure=body.insecure)
            manifest = manifests.read_manifest(layout, ref)
        return [*_layer_lines(manifest, "pulling"), {"status": "verifying sha256 digest"},
                {"status": "writing manifest"}]

    return await _status_response(work, [{"status": "pulling manifest"}], body.stream)


@router.post("/api/push")
@ollama_errors
async def push(request: Request):
    body: ModelBody = await read_body(request, ModelBody)
    name = body.ref

    def work() -> list[dict]:
        from pagoda.store import manifests, registry
        from pagoda.store.layout import default_layout, parse_ref

        layout, ref = default_layout(), parse_ref(name)
        manifest = manifests.read_manifest(layout, ref)
        if manifest is None:
            raise OllamaError(f"model {name!r} not found in the store", 404)
        registry.push(layout, ref, insecure=body.insecure)
        return [*_layer_lines(manifest, "pushing"), {"status": "pushing manifest"}]

    return await _status_response(work, [{"status": "retrieving manifest"}], body.stream)


def _local_ref(name: str):
    from pagoda.store import ollama_store
    from pagoda.store.layout import parse_ref

    if ollama_store.is_ollama_name(name):
        raise OllamaError(f"{name}: pagoda does not write to Ollama's store")
    return parse_ref(name)


@router.delete("/api/delete")
@ollama_errors
async def delete(request: Request):
    body: ModelBody = await read_body(request, ModelBody)
    from pagoda.store import manifests
    from pagoda.store.layout import default_layout

    ref, layout = _local_ref(body.ref), default_layout()
    if manifests.read_manifest(layout, ref) is None:
        raise OllamaError(f"model {body.ref!r} not found", 404)
    await asyncio.to_thread(manifests.remove_manifest, layout, ref)
    return Response(status_code=200)


@router.post("/api/copy")
@ollama_errors
async def copy(request: Request):
    body: CopyBody = await read_body(request, CopyBody)
    from pagoda.store import create

    _local_ref(body.destination)
    try:
        await asyncio.to_thread(create.copy_model, body.source, body.destination)
    except ValueError as e:
        status = 404 if "not found" in str(e) else 400
        raise OllamaError(str(e), status) from None
    return Response(status_code=200)


# -- blobs: what `ollama create` uploads before it names the files in /api/create ---------------
_BLOB_DIGEST = re.compile(r"^sha256[:-][0-9a-f]{64}$")


def _blob_digest(digest: str) -> str:
    if not _BLOB_DIGEST.match(digest):
        raise OllamaError(f"invalid digest {digest!r}: expected sha256:<64 hex digits>")
    return "sha256:" + digest[7:]


@router.head("/api/blobs/{digest}")
@ollama_errors
async def blob_exists(digest: str):
    from pagoda.store import blobs
    from pagoda.store.layout import default_layout

    found = blobs.has_blob(default_layout(), _blob_digest(digest))
    return Response(status_code=200 if found else 404)


@router.post("/api/blobs/{digest}")
@ollama_errors
async def upload_blob(digest: str, request: Request):
    """Store the body as the blob `digest`, hashed as it arrives; a body that hashes to anything
    else is refused (400) and leaves nothing behind."""
    from pagoda.store import blobs
    from pagoda.store.layout import default_layout

    expected = _blob_digest(digest)
    layout = default_layout()
    if blobs.has_blob(layout, expected):
        return Response(status_code=200)
    with blobs.BlobWriter(layout) as writer:
        async for chunk in request.stream():
            writer.write(chunk)
        try:
            await asyncio.to_thread(writer.commit, expected)
        except blobs.DigestMismatch as e:
            raise OllamaError(str(e)) from None
    return Response(status_code=201)


def _uploaded_gguf(files: dict[str, str]) -> str:
    """The store path of the one .gguf among uploaded files ({name: digest}, /api/blobs)."""
    from pagoda.store import blobs
    from pagoda.store.layout import default_layout

    ggufs = [(name, digest) for name, digest in files.items() if name.endswith(".gguf")]
    if len(ggufs) != 1:
        raise OllamaError("files must name exactly one .gguf file: pagoda creates models from GGUF weights "
                          f"(got {', '.join(files) or 'none'})", 501 if files else 400)
    name, digest = ggufs[0]
    layout = default_layout()
    if not blobs.has_blob(layout, _blob_digest(digest)):
        raise OllamaError(f"files.{name}: blob {digest} not found; upload it first (POST /api/blobs/{digest})")
    return str(layout.blob_path(_blob_digest(digest)))


def _modelfile_of(body: CreateBody):
    from pagoda.store.modelfile import PARAMETER_TYPES, Modelfile, parse_modelfile

    if body.adapters:
        raise OllamaError("create with adapters is not supported", 501)
    if body.modelfile:
        return parse_modelfile(body.modelfile, source="modelfile")
    if body.files and not body.from_:
        body.from_ = _uploaded_gguf(body.files)
    if not body.from_:
        raise OllamaError("from is required (a model in the store, or a .gguf path on the server)")
    params: dict[str, Any] = {}
    for key, value in (body.parameters or {}).items():
        kind = PARAMETER_TYPES.get(key)
        if kind is None:
            raise OllamaError(f"parameters.{key}: unknown parameter")
        if kind is list:
            value = [value] if isinstance(value, str) else value
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise OllamaError(f"parameters.{key} must be a list of strings")
        elif kind is bool:
            if not isinstance(value, bool):
                raise OllamaError(f"parameters.{key} must be true or false")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise OllamaError(f"parameters.{key} must be {'an integer' if kind is int else 'a number'}")
        params[key] = kind(value) if kind in (int, float) else value
    licenses = [body.license] if isinstance(body.license, str) else list(body.license or [])
    messages = [{"role": str(m.get("role", "")), "content": str(m.get("content", ""))} for m in body.messages or []]
    return Modelfile(from_=body.from_, template=body.template, system=body.system, parameters=params,
                     licenses=licenses, messages=messages)


@router.post("/api/create")
@ollama_errors
async def create_model(request: Request):
    body: CreateBody = await read_body(request, CreateBody)
    name = body.ref
    _local_ref(name)
    modelfile = _modelfile_of(body)

    def work() -> list[dict]:
        from pagoda.store import create

        _, manifest = create.create_model(name, modelfile, quantize=body.quantize)
        return [{"status": f"using layer {layer.digest}"} for layer in manifest.blobs()] + \
               [{"status": "writing manifest"}]

    first = [{"status": "parsing modelfile" if body.modelfile else "creating model"}]
    return await _status_response(work, first, body.stream)
