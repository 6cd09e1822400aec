"""Ollama's HTTP API (`/api/...`) on `pagoda serve`, beside the OpenAI one (`/v1/...`).

`/api/generate` and `/api/chat` run on the served model through the same `Serving` as `/v1`
(admission, `--request-timeout`, metrics): NDJSON lines when `stream` is true (Ollama's default),
one JSON object otherwise, with Ollama's timing fields in nanoseconds. `options` map to sampling
parameters, `format` ("json" or a JSON schema) to structured outputs. `/api/tags`, `/api/show`,
`/api/ps` and `/api/version` describe what is served; `/api/pull`, `/api/push`, `/api/delete`,
`/api/copy` and `/api/create` act on the model store (`pagoda/store`), as `pagoda pull/push/rm/cp/
create` do. One model per server: a store model that is not the served one can be listed,
shown, copied, pushed or deleted but not run (404 naming the served model). `keep_alive` is
accepted and ignored: the served model stays loaded until the server stops.

Errors are Ollama's: `{"error": "..."}` with 400 (bad request), 404 (no such model), 501 (a
feature pagoda does not have), 503 (engine gone or draining), 500 (registry or store failure).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from functools import wraps
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagoda import __version__
from pagoda.entrypoints.disconnect import GONE, unless_disconnected
from pagoda.entrypoints.openai.lifecycle import shutting_down
from pagoda.entrypoints.openai.middleware import ReleasingStream
from pagoda.entrypoints.openai.protocol import random_id
from pagoda.entrypoints.openai.serving import OpenAIError, Serving
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.security.context import request_context

logger = logging.getLogger("pagoda.ollama")
router = APIRouter()

NDJSON = "application/x-ndjson"
# Ollama's defaults for what `options` leaves out (its api.DefaultOptions). repeat_penalty's
# default (1.1 over the last 64 tokens) is not applied: pagoda's repetition penalty covers the
# whole sequence, so it is used only when a request asks for it.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0}
# Options Ollama takes that pagoda accepts and ignores (load-time knobs, samplers it lacks).
IGNORED_OPTIONS = {
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "numa", "low_vram", "f16_kv",
    "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only", "repeat_last_n", "mirostat",
    "mirostat_tau", "mirostat_eta", "tfs_z", "typical_p", "penalize_newline",
}
_FLOAT_OPTIONS = {"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"}
_INT_OPTIONS = {"top_k", "seed", "num_predict"}
NEVER = "2318-01-01T00:00:00Z"  # ps's expires_at: the served model is never unloaded


class OllamaError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def _error(message: str, status: int) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, media_type="application/json")


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), media_type="application/json")


def _line(data: dict) -> bytes:
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS) + b"\n"


def _as_ollama(e: BaseException) -> OllamaError:
    if isinstance(e, OllamaError):
        return e
    if isinstance(e, OpenAIError):
        return OllamaError(e.message, e.status)
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return OllamaError(f"{where}: {first['msg']}" if where else first["msg"])
    if isinstance(e, ValueError):
        return OllamaError(str(e))
    from pagoda.store.registry import RegistryError

    if isinstance(e, (RegistryError, OSError)):
        return OllamaError(str(e), 500)
    raise e


def _ollama_errors(handler: Callable):
    """Ollama's error body for whatever a handler raises that is the client's or the store's
    fault; anything else propagates to the app's 500 handler."""

    @wraps(handler)
    async def wrapped(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except (OllamaError, OpenAIError, ValidationError, ValueError, OSError) as e:
            err = _as_ollama(e)
            response = _error(err.message, err.status)
            if isinstance(e, OpenAIError):  # a 429's Retry-After (the server's limits, --auth-config's)
                response.headers.update(e.headers)
            return response
        except Exception as e:
            from pagoda.store.registry import RegistryError

            if isinstance(e, RegistryError):
                return _error(str(e), 500)
            raise

    return wrapped


async def _body(request: Request, model: type[BaseModel]) -> BaseModel:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise OllamaError(f"invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise OllamaError("the body must be a JSON object")
    return model.model_validate(data)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# -- request bodies (unknown fields ignored, as Ollama does) ------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class _GenerateBase(_Body):
    model: str = ""
    stream: bool = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: float | str | None = None  # accepted; the served model is never unloaded
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class GenerateBody(_GenerateBase):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class ChatMessageBody(_Body):
    role: str
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class ChatBody(_GenerateBase):
    messages: list[ChatMessageBody] | None = None
    tools: list[dict[str, Any]] | None = None


class ModelBody(_Body):
    model: str = ""
    name: str = ""  # Ollama's older name for `model`
    stream: bool = True
    insecure: bool = False
    verbose: bool = False

    @property
    def ref(self) -> str:
        name = self.model or self.name
        if not name:
            raise OllamaError("model is required")
        return name


class CopyBody(_Body):
    source: str
    destination: str


class CreateBody(ModelBody):
    from_: str | None = Field(default=None, alias="from")
    modelfile: str | None = None  # Ollama's older API: the Modelfile's text
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    quantize: str | None = None
    template: str | None = None
    system: str | None = None
    license: str | list[str] | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)


# -- the served model -------------------------------------------------------------------------
def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _served_name(serving: Serving, model: str) -> str:
    """The served name for a request's `model` (`name` or `name:latest`), else a 404."""
    if not model:
        raise OllamaError("model is required")
    ctx = request_context()  # --auth-config: the key's role may use this name (else 403)
    for candidate in (model, model.removesuffix(":latest")):
        if candidate in serving.accepted_names:
            if ctx is not None:
                ctx.check_model(candidate)
            return serving.model_names[0]
    served = ", ".join(repr(n) for n in (ctx.visible(serving.model_names) if ctx is not None else serving.model_names))
    raise OllamaError(f"model {model!r} not found: this server runs {served} (one model per server; start "
                      f"`pagoda serve --model {model}` to run it)", 404)


def _store_visible() -> bool:
    """--auth-config: only an `admin` role sees the model store beyond the served model (its
    write routes are refused earlier, in pagoda/security/access.py)."""
    ctx = request_context()
    return ctx is None or ctx.grant is None or ctx.grant.role.admin


def _visible(names: list[str]) -> list[str]:
    ctx = request_context()
    return ctx.visible(names) if ctx is not None else names


def _check_alive(request: Request) -> None:
    lifecycle, engine = request.app.state.lifecycle, _serving(request).engine
    if lifecycle.draining:
        raise OllamaError(shutting_down().message, 503)
    if not engine.healthy:
        state = "restarting" if engine.restarting else f"not running: {engine.dead_error}"
        raise OllamaError(f"engine is {state}", 503)


def _option(options: dict, name: str):
    value = options.get(name)
    if value is None:
        return None
    if name in _FLOAT_OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise OllamaError(f"options.{name} must be a number, got {value!r}")
    if name in _INT_OPTIONS and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value)):
        raise OllamaError(f"options.{name} must be an integer, got {value!r}")
    return int(value) if name in _INT_OPTIONS else float(value)


def _structured(fmt: str | dict | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return StructuredOutputsParams(json_object=True)
    if isinstance(fmt, dict):
        from pagoda.structured_output.grammar import validate_structured_outputs

        params = StructuredOutputsParams(json=fmt)
        try:
            validate_structured_outputs(params, "format")
        except ValueError as e:
            raise OllamaError(f"format: {e}") from None
        return params
    raise OllamaError(f'format must be "json" or a JSON schema object, got {fmt!r}')


_OLLAMA_NAMES = {"repetition_penalty": "repeat_penalty"}  # SamplingParams field → Ollama option, where they differ


def sampling_params(serving: Serving, body: _GenerateBase, prompt_len: int) -> SamplingParams:
    """`options` and `format` → SamplingParams (Ollama's defaults for what is not given)."""
    options = dict(body.options or {})
    unknown = set(options) - IGNORED_OPTIONS - _FLOAT_OPTIONS - _INT_OPTIONS - {"stop"}
    if unknown:
        logger.warning("ignoring unknown options %s", sorted(unknown))
    values = {name: _option(options, name) for name in _FLOAT_OPTIONS | _INT_OPTIONS}
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
            stop=stop or None, structured_outputs=_structured(body.format))
    except ValueError as e:
        raise OllamaError(f"options: {e}") from None


def _refuse_unsupported(body: _GenerateBase) -> None:
    if body.think not in (None, False, ""):
        raise OllamaError("this model does not support thinking (`think`)")
    if body.logprobs or body.top_logprobs:
        raise OllamaError("logprobs are not supported on the Ollama API yet; use /v1/completions or "
                          "/v1/chat/completions with logprobs")


def _generate_prompt(serving: Serving, body: GenerateBody) -> list[int]:
    tokenizer = serving.tokenizer
    prompt = body.prompt or ""
    serving.check_prompt_chars(len(prompt) + len(body.system or ""))
    serving.check_input([prompt, body.system or ""])  # the content filter (--moderation-words)
    if body.raw:
        if body.system or body.template:
            raise OllamaError("raw prompts take no `system` or `template`")
        ids = tokenizer.encode(prompt)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                   [{"role": "user", "content": prompt}]
        if body.template:
            ids = tokenizer.encode(_render_go_template(serving, body.template, messages), add_special_tokens=False)
        elif tokenizer.chat_template:
            ids = serving.encode_chat(messages, True)
        else:  # no template: the prompt as given (Ollama's default template is `{{ .Prompt }}`)
            ids = tokenizer.encode(f"{body.system}\n\n{prompt}" if body.system else prompt)
    return list(body.context or []) + ids


def _render_go_template(serving: Serving, template: str, messages: list[dict]) -> str:
    """A request's `template` (an Ollama Go template), through pagoda's Go → Jinja converter."""
    from pagoda.store.gotemplate import to_jinja
    from pagoda.tokenizer import _compile_template

    try:
        jinja = _compile_template(to_jinja(template))
        tokenizer = serving.tokenizer
        return jinja.render(messages=messages, add_generation_prompt=True, bos_token=tokenizer.bos_token or "",
                            eos_token=tokenizer.eos_token or "")
    except Exception as e:  # noqa: BLE001 - the converter's ValueError, or jinja's TemplateError
        raise OllamaError(f"template: {e}") from None


def _chat_prompt(serving: Serving, body: ChatBody) -> list[int]:
    if body.tools:
        raise OllamaError("tools are not supported on /api/chat yet; use /v1/chat/completions with tools", 501)
    messages = []
    for i, m in enumerate(body.messages or []):
        if m.images:
            raise OllamaError(f"messages.{i}.images: this model does not support images (pagoda serves text models)")
        message = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        messages.append(message)
    serving.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
    serving.check_input([m["content"] for m in messages], "messages")  # the content filter (--moderation-words)
    if not serving.tokenizer.chat_template:
        raise OllamaError("this model has no chat template; start the server with --chat-template")
    return serving.encode_chat(messages, True)


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


async def _run(request: Request, body: _GenerateBase, ids: list[int], model: str, shape: Callable[[str], dict],
               final_extra: Callable[[list[int]], dict]) -> Response:
    """Run one prompt; stream NDJSON lines (`shape(text)` each) or answer one object."""
    serving = _serving(request)
    params = sampling_params(serving, body, len(ids))
    admission = serving.admission()
    try:
        serving.check_capacity(1, admission)
        request_id = random_id("ollama")

        async def results() -> AsyncIterator[tuple[str, list[int], str | None]]:
            async for _, out in serving.run_all([ids], [params], request_id, 0):
                c = out.outputs[0]
                yield c.text, list(c.token_ids), c.finish_reason

        timing = _Timing(len(ids))
        if body.stream:
            async def lines() -> AsyncIterator[bytes]:
                generated: list[int] = []
                reason = None
                try:
                    async for text, token_ids, reason in results():
                        timing.saw(len(token_ids))
                        generated += token_ids
                        if text:
                            yield _line({"model": model, "created_at": _now(), **shape(text), "done": False})
                    yield _line({"model": model, "created_at": _now(), **shape(""), **timing.fields(_done_reason(reason)),
                                 **final_extra(generated)})
                except OpenAIError as e:
                    yield _line({"error": e.message})

            response = ReleasingStream(lines(), admission.release, media_type=NDJSON)
            admission = None
            return response

        async def collect() -> dict:
            text, generated, reason = "", [], None
            async for piece, token_ids, reason in results():
                timing.saw(len(token_ids))
                text += piece
                generated += token_ids
            return {"model": model, "created_at": _now(), **shape(text), **timing.fields(_done_reason(reason)),
                    **final_extra(generated)}

        result = await unless_disconnected(request, collect())
        return _json(result) if result is not GONE else Response(status_code=499)
    finally:
        if admission is not None:
            admission.release()


async def _generation_request(request: Request, kind: type[_GenerateBase]):
    """/api/generate's or /api/chat's body, the serving and the served name, once the body,
    the model and the engine's health pass and nothing unsupported is asked for."""
    body = await _body(request, kind)
    serving = _serving(request)
    model = _served_name(serving, body.model)
    _check_alive(request)
    _refuse_unsupported(body)
    return body, serving, model


@router.post("/api/generate")
@_ollama_errors
async def generate(request: Request):
    body, serving, model = await _generation_request(request, GenerateBody)
    if body.images:
        raise OllamaError("images: this model does not support images (pagoda serves text models)")
    if body.suffix:
        raise OllamaError("suffix (fill-in-the-middle) is not supported")
    if not body.prompt and not body.context:
        # Ollama's "load the model" request: the model is always loaded here.
        return _json({"model": model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"})
    ids = _generate_prompt(serving, body)
    extra = (lambda generated: {}) if body.raw else (lambda generated: {"context": ids + generated})
    return await _run(request, body, ids, model, lambda text: {"response": text}, extra)


@router.post("/api/chat")
@_ollama_errors
async def chat(request: Request):
    body, serving, model = await _generation_request(request, ChatBody)
    if not body.messages:
        return _json({"model": model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                      "done": True, "done_reason": "load"})
    ids = _chat_prompt(serving, body)
    return await _run(request, body, ids, model,
                      lambda text: {"message": {"role": "assistant", "content": text}}, lambda generated: {})


# -- describing models ------------------------------------------------------------------------
def _served_info(serving: Serving) -> dict:
    """What /api/tags, /api/show and /api/ps say about the served model (computed once)."""
    cached = getattr(serving, "_ollama_info", None)
    if cached is not None:
        return cached
    from pagoda.store.model_info import human_count

    cfg = serving.engine.engine.config.model
    files, hf = cfg.files, cfg.hf_config
    weights = [files.gguf_file] if files.gguf_file else sorted(Path(files.metadata_dir).glob("*.safetensors"))
    size = sum(p.stat().st_size for p in weights if p.exists())
    params = _parameter_count(weights)
    family = hf.get("model_type") or cfg.architecture
    store = _store_entry(files.name)
    info = {
        "source": files.name,
        "size": size,
        "digest": store["digest"] if store else "",
        "modified_at": store["modified_at"] if store else _iso(max((p.stat().st_mtime for p in weights), default=0)),
        "details": {"parent_model": "", "format": files.format, "family": family, "families": [family],
                    "parameter_size": human_count(params) if params else "",
                    "quantization_level": _quantization_level(cfg)},
        "model_info": {
            "general.architecture": family, "general.parameter_count": params,
            f"{family}.context_length": serving.max_model_len,
            f"{family}.embedding_length": hf.get("hidden_size"), f"{family}.block_count": hf.get("num_hidden_layers"),
            f"{family}.attention.head_count": hf.get("num_attention_heads"),
            f"{family}.attention.head_count_kv": hf.get("num_key_value_heads", hf.get("num_attention_heads")),
            f"{family}.vocab_size": hf.get("vocab_size"),
        },
        "store_name": store["name"] if store else None,
    }
    serving._ollama_info = info
    return info


def _quantization_level(cfg) -> str:
    """Ollama's names: F32, F16, BF16; pagoda's --quantization modes as they are (INT8, INT4, GGUF)."""
    if cfg.quantization:
        return cfg.quantization.upper()
    dtype = str(cfg.dtype).removeprefix("torch.")
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(dtype, dtype.upper())


def _parameter_count(weights: list[Path]) -> int:
    """Exact, from the files' headers (no tensor is read): GGUF via model_info, safetensors by
    their JSON header."""
    total = 0
    for path in weights:
        try:
            if path.suffix == ".gguf":
                from pagoda.store.model_info import gguf_info

                total += gguf_info(path)["parameters"]
                continue
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            for name, meta in header.items():
                if name != "__metadata__":
                    count = 1
                    for dim in meta["shape"]:
                        count *= dim
                    total += count
        except (OSError, ValueError, KeyError):
            return 0
    return total


def _store_entry(name: str) -> dict | None:
    """The store's record of `--model` when it names a store model (not a path)."""
    if not name or Path(name).expanduser().exists():
        return None
    try:
        from pagoda.store import manifests, ollama_store
        from pagoda.store.layout import default_layout, digest_hex, parse_ref

        if ollama_store.is_ollama_name(name):
            layout, ref = ollama_store.ollama_layout(), ollama_store.parse_ollama_name(name)
        else:
            layout, ref = default_layout(), parse_ref(name)
        manifest = manifests.read_manifest(layout, ref)
        if manifest is None:
            return None
        return {"name": name if ollama_store.is_ollama_name(name) else ref.short(),
                "digest": digest_hex(manifest.digest), "modified_at": _iso(manifests.manifest_mtime(layout, ref))}
    except (ValueError, OSError):
        return None


def _store_models() -> list[dict]:
    """/api/tags rows for the models in pagoda's store."""
    from pagoda.store import manifests
    from pagoda.store.layout import default_layout, digest_hex

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
        rows.append({"name": ref.short(), "model": ref.short(), "modified_at": _iso(manifests.manifest_mtime(layout, ref)),
                     "size": manifest.total_size, "digest": digest_hex(manifest.digest),
                     "details": {"parent_model": "", "format": config.get("model_format") or "gguf", "family": family,
                                 "families": config.get("model_families") or ([family] if family else []),
                                 "parameter_size": config.get("model_type") or "",
                                 "quantization_level": config.get("file_type") or ""}})
    return rows


@router.get("/api/tags")
@_ollama_errors
async def tags(request: Request):
    serving = _serving(request)
    info = await asyncio.to_thread(_served_info, serving)
    served = [{"name": name, "model": name, "modified_at": info["modified_at"], "size": info["size"],
               "digest": info["digest"], "details": info["details"]} for name in _visible(serving.model_names)]
    seen = {row["name"] for row in served} | {info["store_name"]}
    stored = [row for row in await asyncio.to_thread(_store_models) if row["name"] not in seen] \
        if _store_visible() else []
    return _json({"models": served + stored})


@router.get("/api/ps")
@_ollama_errors
async def ps(request: Request):
    serving = _serving(request)
    info = await asyncio.to_thread(_served_info, serving)
    on_gpu = serving.engine.engine.config.model.device.type == "cuda"
    return _json({"models": [{"name": name, "model": name, "size": info["size"], "digest": info["digest"],
                              "details": info["details"], "expires_at": NEVER,
                              "size_vram": info["size"] if on_gpu else 0, "context_length": serving.max_model_len}
                             for name in _visible(serving.model_names)]})


@router.get("/api/version")
async def version():
    return _json({"version": __version__})


def _parameters_text(params: dict) -> str:
    lines = []
    for key, value in params.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"{key:<30} {json.dumps(v) if isinstance(v, str) else v}")
    return "\n".join(lines)


def _show_store(name: str) -> dict:
    from pagoda.store.commands import _modelfile_text, describe

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
                       f"{arch}.embedding_length": m.get("embedding_length"), f"{arch}.block_count": m.get("block_count")},
        "capabilities": ["completion"],
    }


@router.post("/api/show")
@_ollama_errors
async def show(request: Request):
    body: ModelBody = await _body(request, ModelBody)
    serving = _serving(request)
    name = body.ref
    try:
        _served_name(serving, name)
    except OllamaError:  # not the served model: one in the store, perhaps
        if not _store_visible():
            raise
        try:
            return _json(await asyncio.to_thread(_show_store, name))
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
    shown["model_info"] = {**shown.get("model_info", {}), **{k: v for k, v in info["model_info"].items() if v is not None}}
    shown["modified_at"] = info["modified_at"]
    return _json(shown)


# -- the store --------------------------------------------------------------------------------
async def _status_response(work: Callable[[], list[dict]], first: list[dict], stream: bool) -> Response:
    """Run blocking store `work` on a thread. Streamed: Ollama's status lines (`first`, what
    `work` returns, then success; a failure is an `{"error"}` line). Else one `{"status":
    "success"}`, or the error with its status code."""
    if not stream:
        await asyncio.to_thread(work)
        return _json({"status": "success"})

    async def lines():
        for line in first:
            yield _line(line)
        try:
            for line in await asyncio.to_thread(work):
                yield _line(line)
        except Exception as e:  # noqa: BLE001 - reported on the stream, as Ollama does
            try:
                err = _as_ollama(e)
            except Exception:
                logger.exception("store operation failed")
                err = OllamaError(f"internal error: {type(e).__name__}", 500)
            yield _line({"error": err.message})
            return
        yield _line({"status": "success"})

    return StreamingResponse(lines(), media_type=NDJSON)


def _layer_lines(manifest, verb: str) -> list[dict]:
    return [{"status": f"{verb} {layer.digest.removeprefix('sha256:')[:12]}", "digest": layer.digest,
             "total": layer.size, "completed": layer.size} for layer in manifest.blobs()]


@router.post("/api/pull")
@_ollama_errors
async def pull(request: Request):
    body: ModelBody = await _body(request, ModelBody)
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
@_ollama_errors
async def push(request: Request):
    body: ModelBody = await _body(request, ModelBody)
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
@_ollama_errors
async def delete(request: Request):
    body: ModelBody = await _body(request, ModelBody)
    from pagoda.store import manifests
    from pagoda.store.layout import default_layout

    ref, layout = _local_ref(body.ref), default_layout()
    if manifests.read_manifest(layout, ref) is None:
        raise OllamaError(f"model {body.ref!r} not found", 404)
    await asyncio.to_thread(manifests.remove_manifest, layout, ref)
    return Response(status_code=200)


@router.post("/api/copy")
@_ollama_errors
async def copy(request: Request):
    body: CopyBody = await _body(request, CopyBody)
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
@_ollama_errors
async def blob_exists(digest: str):
    from pagoda.store import blobs
    from pagoda.store.layout import default_layout

    found = blobs.has_blob(default_layout(), _blob_digest(digest))
    return Response(status_code=200 if found else 404)


@router.post("/api/blobs/{digest}")
@_ollama_errors
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
@_ollama_errors
async def create_model(request: Request):
    body: CreateBody = await _body(request, CreateBody)
    name = body.ref
    _local_ref(name)
    modelfile = _modelfile_of(body)

    def work() -> list[dict]:
        from pagoda.store import create

        _, manifest = create.create_model(name, modelfile, quantize=body.quantize)
        return [{"status": f"using layer {layer.digest}"} for layer in manifest.blobs()] + \
               [{"status": "writing manifest"}]

    return await _status_response(work, [{"status": "parsing modelfile" if body.modelfile else "creating model"}], body.stream)
