"""Shared pieces of Ollama's API: its error bodies and JSON helpers, Ollama's option defaults, and
the request bodies (unknown fields ignored, as Ollama does)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from functools import wraps
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagoda.entrypoints import input_limits as limits
from pagoda.entrypoints.openai.errors import OpenAIError

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
FLOAT_OPTIONS = {"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"}
INT_OPTIONS = {"top_k", "seed", "num_predict"}
NEVER = "2318-01-01T00:00:00Z"  # ps's expires_at: the served model is never unloaded


class OllamaError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def ollama_error_response(message: str, status: int) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, media_type="application/json")


def json_response(data: Any) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), media_type="application/json")


def ndjson_line(data: dict) -> bytes:
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS) + b"\n"


def as_ollama_error(e: BaseException) -> OllamaError:
    if isinstance(e, OllamaError):
        return e
    if isinstance(e, OpenAIError):
        return OllamaError(e.message, e.status)
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        return OllamaError(f"{where}: {message}" if where and not message.startswith(where) else message)
    if isinstance(e, ValueError):
        return OllamaError(str(e))
    from pagoda.store.oci_client import RegistryError  # deferred: loads httpx

    if isinstance(e, (RegistryError, OSError)):
        return OllamaError(str(e), 500)
    raise e


def ollama_errors(handler: Callable):
    """Ollama's error body for whatever a handler raises that is the client's or the store's
    fault; anything else propagates to the app's 500 handler."""

    @wraps(handler)
    async def wrapped(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except (OllamaError, OpenAIError, ValidationError, ValueError, OSError) as e:
            err = as_ollama_error(e)
            response = ollama_error_response(err.message, err.status)
            if isinstance(e, OpenAIError):  # a 429's Retry-After (the server's limits, --auth-config's)
                response.headers.update(e.headers)
            return response
        except Exception as e:
            from pagoda.store.oci_client import RegistryError  # deferred: loads httpx

            if isinstance(e, RegistryError):
                return ollama_error_response(str(e), 500)
            raise

    return wrapped


async def read_body(request: Request, model: type[BaseModel]) -> BaseModel:
    raw = await request.body()
    try:
        data = limits.parse_json_object(raw)
    except ValueError as e:
        raise OllamaError(str(e)) from None
    return model.model_validate(data)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# -- request bodies (unknown fields ignored, as Ollama does) ------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class GenerateBase(_Body):
    model: str = ""
    stream: bool = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: float | str | None = None  # accepted; the served model is never unloaded
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    # The limits /v1 has (input_limits.py): a schema's size, the options' nesting, stop's count.
    @field_validator("format", mode="before")
    @classmethod
    def _bounded_format(cls, value: Any) -> Any:
        return limits.check_json(value, "format")

    @field_validator("options", mode="before")
    @classmethod
    def _bounded_options(cls, value: Any) -> Any:
        if isinstance(value, dict):  # first: the clearer message for 100,000 stop strings
            limits.check_stop(value.get("stop"), "options.stop")
        return limits.check_json(value, "options")


class GenerateBody(GenerateBase):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    @field_validator("template", mode="before")
    @classmethod
    def _bounded_template(cls, value: Any) -> Any:
        return limits.check_template(value)


class ChatMessageBody(_Body):
    role: str
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _bounded_calls(cls, value: Any) -> Any:
        return limits.check_depth(value, "tool_calls")


class ChatBody(GenerateBase):
    messages: list[ChatMessageBody] | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _bounded_tools(cls, value: Any) -> Any:
        return limits.check_json(value, "tools")


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

    @field_validator("template", mode="before")
    @classmethod
    def _bounded_template(cls, value: Any) -> Any:
        return limits.check_template(value)

    @field_validator("parameters", "messages", "files", mode="before")
    @classmethod
    def _bounded(cls, value: Any, info) -> Any:
        return limits.check_json(value, info.field_name)
