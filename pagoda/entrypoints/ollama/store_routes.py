"""The model store through Ollama's API: `/api/pull`, `/api/push`, `/api/delete`, `/api/copy`,
`/api/blobs` and `/api/create`, each calling pagoda/store on a thread.

With `--auth-config` every one of them is an admin's (pagoda/security/access.py refuses the
others before a byte of the body is read). Uploads have a budget (`BlobPolicy`): one blob is at
most `--max-blob-size` (413 past it, the partial file removed), and blobs no model uses are
pruned once older than `--blob-grace`: at start-up, before each upload and after each create.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
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
from pagoda.security.options import DEFAULT_BLOB_GRACE, DEFAULT_MAX_BLOB_GIB
from pagoda.store import blobs, create, manifests, ollama_store, prune
from pagoda.store.layout import default_layout, parse_ref
from pagoda.store.modelfile import PARAMETER_TYPES, Modelfile, parse_modelfile

logger = logging.getLogger("pagoda.ollama")
router = APIRouter()
GiB = 1 << 30


# -- what uploads may take -------------------------------------------------------------------
@dataclass(frozen=True)
class BlobPolicy:
    """`--max-blob-size` in bytes, and `--blob-grace` in seconds (None: never prune, as Ollama's
    OLLAMA_NOPRUNE)."""

    max_bytes: int = int(DEFAULT_MAX_BLOB_GIB * GiB)
    grace: float | None = DEFAULT_BLOB_GRACE

    @classmethod
    def from_args(cls, args) -> BlobPolicy:
        """serve's options; ValueError naming a bad one."""
        size, grace = args.max_blob_size, args.blob_grace
        if not size > 0:
            raise ValueError(f"--max-blob-size must be > 0 GiB, got {size}")
        if math.isnan(grace):
            raise ValueError("--blob-grace must be a number of seconds (-1: never prune)")
        return cls(int(min(size * GiB, 2**63 - 1)), None if grace < 0 else float(grace))


def install_blob_policy(app: FastAPI, policy: BlobPolicy) -> None:
    """The app's upload budget, and a prune of the store when it starts."""
    app.state.blob_policy = policy

    async def prune_at_start() -> None:
        await asyncio.to_thread(_prune, policy)

    app.router.on_startup.append(prune_at_start)


def _policy(request: Request) -> BlobPolicy:
    return getattr(request.app.state, "blob_policy", None) or BlobPolicy()


def _prune(policy: BlobPolicy) -> None:
    """Delete the store's blobs no manifest names, older than the grace (pagoda.store.prune)."""
    if policy.grace is None:
        return
    removed = prune.prune_unreferenced(default_layout(), policy.grace)
    if removed:
        logger.info("pruned %d unreferenced blob(s) older than %g s: %s", len(removed), policy.grace,
                    ", ".join(p.name for p in removed))


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
        from pagoda.store import create, manifests, oci_client  # deferred: loads httpx

        layout = default_layout()
        entry = create.catalog_entry_for(name)
        if entry is not None:
            ref, manifest = create.record_catalog_model(layout, entry.name)
        else:
            ref = parse_ref(name)
            oci_client.pull(layout, ref, insecure=body.insecure)
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
        from pagoda.store import manifests, oci_client  # deferred: loads httpx

        layout, ref = default_layout(), parse_ref(name)
        manifest = manifests.read_manifest(layout, ref)
        if manifest is None:
            raise OllamaError(f"model {name!r} not found in the store", 404)
        oci_client.push(layout, ref, insecure=body.insecure)
        return [*_layer_lines(manifest, "pushing"), {"status": "pushing manifest"}]

    return await _status_response(work, [{"status": "retrieving manifest"}], body.stream)


def _local_ref(name: str):
    if ollama_store.is_ollama_name(name):
        raise OllamaError(f"{name}: pagoda does not write to Ollama's store")
    return parse_ref(name)


@router.delete("/api/delete")
@ollama_errors
async def delete(request: Request):
    body: ModelBody = await read_body(request, ModelBody)

    ref, layout = _local_ref(body.ref), default_layout()
    if manifests.read_manifest(layout, ref) is None:
        raise OllamaError(f"model {body.ref!r} not found", 404)
    await asyncio.to_thread(manifests.remove_manifest, layout, ref)
    return Response(status_code=200)


@router.post("/api/copy")
@ollama_errors
async def copy(request: Request):
    body: CopyBody = await read_body(request, CopyBody)

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


def _touch_if_present(digest: str) -> bool:
    """Whether the store has the blob; one that is restarts its grace (`ollama create` asks with
    HEAD before it names the blob in /api/create, so it is not pruned in between). Its ctime,
    not its mtime: a blob hard-linked from the catalog shares its inode, whose mtime the
    catalog's marker and the GGUF conversion cache key on."""
    path = default_layout().blob_path(digest)
    try:
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same times: only ctime moves
    except FileNotFoundError:
        return False
    return True


@router.head("/api/blobs/{digest}")
@ollama_errors
async def blob_exists(digest: str):
    found = await asyncio.to_thread(_touch_if_present, _blob_digest(digest))
    return Response(status_code=200 if found else 404)


def _too_large(policy: BlobPolicy) -> OllamaError:
    return OllamaError(f"the blob is larger than the server's --max-blob-size ({policy.max_bytes} bytes)", 413)


@router.post("/api/blobs/{digest}")
@ollama_errors
async def upload_blob(digest: str, request: Request):
    """Store the body as the blob `digest`, hashed as it arrives; a body that hashes to anything
    else is refused (400), one over --max-blob-size is refused (413) as soon as its length or
    its bytes say so; either leaves nothing behind."""
    expected, policy = _blob_digest(digest), _policy(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_bytes:
        raise _too_large(policy)
    await asyncio.to_thread(_prune, policy)  # what earlier uploads left unused makes room first
    if await asyncio.to_thread(_touch_if_present, expected):
        return Response(status_code=200)
    with blobs.BlobWriter(default_layout()) as writer:  # leaving it on an error removes the file
        async for chunk in request.stream():
            if writer.size + len(chunk) > policy.max_bytes:
                raise _too_large(policy)
            writer.write(chunk)
        try:
            await asyncio.to_thread(writer.commit, expected)
        except blobs.DigestMismatch as e:
            raise OllamaError(str(e)) from None
    return Response(status_code=201)


def _uploaded_gguf(files: dict[str, str]) -> str:
    """The store path of the one .gguf among uploaded files ({name: digest}, /api/blobs)."""
    ggufs = [(name, digest) for name, digest in files.items() if name.endswith(".gguf")]
    if len(ggufs) != 1:
        raise OllamaError("files must name exactly one .gguf file: pagoda creates models from GGUF weights "
                          f"(got {', '.join(files) or 'none'})", 501 if files else 400)
    name, digest = ggufs[0]
    layout = default_layout()
    if not blobs.has_blob(layout, _blob_digest(digest)):
        raise OllamaError(f"files.{name}: blob {digest} not found; upload it first (POST /api/blobs/{digest})")
    return str(layout.blob_path(_blob_digest(digest)))


def _uploaded_adapter(adapters: dict[str, str]) -> str:
    """The store path of the adapter among uploaded files ({name: digest}): one .gguf (a PEFT
    adapter is converted to one when the model is created from a directory, `pagoda create`)."""
    ggufs = [name for name in adapters if name.endswith(".gguf")]
    if len(ggufs) != 1 or len(adapters) != 1:
        raise OllamaError("adapters must name exactly one .gguf file (a LoRA adapter as llama.cpp writes it; "
                          f"give a PEFT directory to `pagoda create` instead), got {', '.join(adapters)}", 400)
    return _uploaded_gguf(adapters)


def _modelfile_of(body: CreateBody):
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
                     licenses=licenses, messages=messages,
                     adapter=_uploaded_adapter(body.adapters) if body.adapters else None)


@router.post("/api/create")
@ollama_errors
async def create_model(request: Request):
    body: CreateBody = await read_body(request, CreateBody)
    name = body.ref
    _local_ref(name)
    modelfile = _modelfile_of(body)
    policy = _policy(request)

    def work() -> list[dict]:
        _, manifest = create.create_model(name, modelfile, quantize=body.quantize)
        _prune(policy)  # a tag created over an older one leaves that one's layers unused
        return [{"status": f"using layer {layer.digest}"} for layer in manifest.blobs()] + \
               [{"status": "writing manifest"}]

    first = [{"status": "parsing modelfile" if body.modelfile else "creating model"}]
    return await _status_response(work, first, body.stream)
