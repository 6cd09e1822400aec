"""What Ollama's API says about models: `/api/tags`, `/api/ps`, `/api/show`, `/api/version`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagoda import __version__
from pagoda.entrypoints.ollama.common import (
    NEVER,
    ModelBody,
    OllamaError,
    iso_time,
    json_response,
    ollama_errors,
    read_body,
)
from pagoda.entrypoints.ollama.generation import (
    served_name,
    serving_of,
    store_visible,
    visible_names,
)
from pagoda.entrypoints.openai.serving import Serving
from pagoda.store import manifests, ollama_store
from pagoda.store.commands import _modelfile_text, describe
from pagoda.store.layout import default_layout, digest_hex, parse_ref
from pagoda.store.model_info import human_count, parameter_count

router = APIRouter()


# -- describing models ------------------------------------------------------------------------
def _served_info(serving: Serving) -> dict:
    """What /api/tags, /api/show and /api/ps say about the served model (computed once)."""
    cached = getattr(serving, "_ollama_info", None)
    if cached is None:
        cached = serving._ollama_info = model_description(serving.engine.config.model, serving.max_model_len)
    return cached


def model_description(cfg, max_model_len: int) -> dict:
    """What Ollama's API says about a model of this ModelConfig (pagoda/config.py), loaded or not."""
    files, hf = cfg.files, cfg.hf_config
    weights = [files.gguf_file] if files.gguf_file else sorted(Path(files.metadata_dir).glob("*.safetensors"))
    size = sum(p.stat().st_size for p in weights if p.exists())
    params = parameter_count(weights)
    family = hf.get("model_type") or cfg.architecture
    store = _store_entry(files.name)
    return {
        "source": files.name,
        "size": size,
        "digest": store["digest"] if store else "",
        "modified_at": store["modified_at"] if store
        else iso_time(max((p.stat().st_mtime for p in weights), default=0)),
        "details": {"parent_model": "", "format": files.format, "family": family, "families": [family],
                    "parameter_size": human_count(params) if params else "",
                    "quantization_level": _quantization_level(cfg)},
        "model_info": {
            "general.architecture": family, "general.parameter_count": params,
            f"{family}.context_length": max_model_len,
            f"{family}.embedding_length": hf.get("hidden_size"), f"{family}.block_count": hf.get("num_hidden_layers"),
            f"{family}.attention.head_count": hf.get("num_attention_heads"),
            f"{family}.attention.head_count_kv": hf.get("num_key_value_heads", hf.get("num_attention_heads")),
            f"{family}.vocab_size": hf.get("vocab_size"),
        },
        "store_name": store["name"] if store else None,
    }


def _quantization_level(cfg) -> str:
    """Ollama's names: F32, F16, BF16; pagoda's --quantization modes as they are (INT8, INT4, GGUF)."""
    if cfg.quantization:
        return cfg.quantization.upper()
    dtype = str(cfg.dtype).removeprefix("torch.")
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype.upper())


def _store_entry(name: str) -> dict | None:
    """The store's record of `--model` when it names a store model (not a path)."""
    if not name or Path(name).expanduser().exists():
        return None
    try:
        if ollama_store.is_ollama_name(name):
            layout, ref = ollama_store.ollama_layout(), ollama_store.parse_ollama_name(name)
        else:
            layout, ref = default_layout(), parse_ref(name)
        manifest = manifests.read_manifest(layout, ref)
        if manifest is None:
            return None
        return {"name": name if ollama_store.is_ollama_name(name) else ref.short(),
                "digest": digest_hex(manifest.digest), "modified_at": iso_time(manifests.manifest_mtime(layout, ref))}
    except (ValueError, OSError):
        return None


def _store_models() -> list[dict]:
    """/api/tags rows for the models in pagoda's store."""
    layout = default_layout()
    rows = []
    for ref in layout.refs():
        try:
            manifest = manifests.read_manifest(layout, ref)
            if manifest is None:
                continue
            config = json.loads(layout.blob_path(manifest.config.digest).read_bytes())
        except (ValueError, OSError):
            continue
        family = config.get("model_family") or ""
        rows.append({"name": ref.short(), "model": ref.short(),
                     "modified_at": iso_time(manifests.manifest_mtime(layout, ref)),
                     "size": manifest.total_size, "digest": digest_hex(manifest.digest),
                     "details": {"parent_model": "", "format": config.get("model_format") or "gguf", "family": family,
                                 "families": config.get("model_families") or ([family] if family else []),
                                 "parameter_size": config.get("model_type") or "",
                                 "quantization_level": config.get("file_type") or ""}})
    return rows


def tag_row(name: str, info: dict) -> dict:
    """/api/tags' row for a served model described by `model_description`."""
    return {"name": name, "model": name, "modified_at": info["modified_at"], "size": info["size"],
            "digest": info["digest"], "details": info["details"]}


async def tags_response(served: list[tuple[str, dict]]) -> Response:
    """/api/tags: the served models (name, description), then the store's other models."""
    rows = [tag_row(name, info) for name, info in served]
    seen = {row["name"] for row in rows} | {info["store_name"] for _, info in served}
    stored = [row for row in await asyncio.to_thread(_store_models) if row["name"] not in seen] \
        if store_visible() else []
    return json_response({"models": rows + stored})


def ps_row(name: str, info: dict, context_length: int, on_gpu: bool, expires_at: str = NEVER,
           size: int | None = None) -> dict:
    """/api/ps' row for a loaded model (`size`: its memory, default the files' size)."""
    size = info["size"] if size is None else size
    return {"name": name, "model": name, "size": size, "digest": info["digest"], "details": info["details"],
            "expires_at": expires_at, "size_vram": size if on_gpu else 0, "context_length": context_length}


@router.get("/api/tags")
@ollama_errors
async def tags(request: Request):
    serving = serving_of(request)
    info = await asyncio.to_thread(_served_info, serving)
    return await tags_response([(name, info) for name in visible_names(serving.model_names)])


@router.get("/api/ps")
@ollama_errors
async def ps(request: Request):
    serving = serving_of(request)
    info = await asyncio.to_thread(_served_info, serving)
    on_gpu = serving.engine.config.model.device.type == "cuda"
    return json_response({"models": [ps_row(name, info, serving.max_model_len, on_gpu)
                                     for name in visible_names(serving.model_names)]})


@router.get("/api/version")
async def version():
    return json_response({"version": __version__})


def _parameters_text(params: dict) -> str:
    lines = []
    for key, value in params.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"{key:<30} {json.dumps(v) if isinstance(v, str) else v}")
    return "\n".join(lines)


def _show_store(name: str) -> dict:
    d = describe(name)
    m = d["model"]
    arch = m.get("architecture") or ""
    template = d["template"] if d["template"] is not None else (d["gguf_chat_template"] or "")
    return {
        "modelfile": _modelfile_text(d), "parameters": _parameters_text(d["parameters"]), "template": template,
        "system": d["system"] or "", "license": "\n\n".join(d["license"]),
        "details": {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else [],
                    "parameter_size": m.get("parameter_size") or "", "quantization_level": m.get("quantization") or ""},
        "model_info": {"general.architecture": arch, "general.parameter_count": m.get("parameters"),
                       f"{arch}.context_length": m.get("context_length"),
                       f"{arch}.embedding_length": m.get("embedding_length"),
                       f"{arch}.block_count": m.get("block_count")},
        "capabilities": ["completion"],
    }


@router.post("/api/show")
@ollama_errors
async def show(request: Request):
    body: ModelBody = await read_body(request, ModelBody)
    serving = getattr(request.app.state, "serving", None)  # None on the front of several models: the store's
    name = body.ref
    try:
        if serving is None:
            raise OllamaError(f"model {name!r} not found", 404)
        served_name(serving, name)
    except OllamaError:  # not the served model: one in the store, perhaps
        if not store_visible():
            raise
        try:
            return json_response(await asyncio.to_thread(_show_store, name))
        except ValueError as e:
            raise OllamaError(f"model {name!r} not found ({e})", 404) from None
    info = await asyncio.to_thread(_served_info, serving)
    shown: dict = {}
    if info["store_name"]:
        try:
            shown = await asyncio.to_thread(_show_store, info["source"])
        except ValueError:
            shown = {}
    template = serving.tokenizer.chat_template or ""
    shown.setdefault("modelfile", f"# Modelfile of {name}, served by pagoda\nFROM {info['source']}\n")
    shown.setdefault("parameters", "")
    shown.setdefault("template", template)
    shown.setdefault("capabilities", ["completion"])
    shown["details"] = info["details"]
    shown["model_info"] = {**shown.get("model_info", {}),
                           **{k: v for k, v in info["model_info"].items() if v is not None}}
    shown["modified_at"] = info["modified_at"]
    return json_response(shown)
