"""LoRA adapters as the server names them (vLLM's interface): ``--lora-modules name=path``,
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (the admin role's, with
--auth-config), a request's ``model`` picking an adapter, and ``/v1/models`` listing each adapter
with its base as ``parent``.

Loading a name again with ``load_inplace: true`` swaps in the new version atomically: the name
points to a new ``LoRARequest`` (a new id) in one assignment, so a request already running keeps
the version it started with, the next one gets the new one, and the prefix cache, which keys on
the files' fingerprint, never gives one version's KV to the other.

Every API (completions, chat, sessions, Responses, Messages, Ollama, gRPC) checks its model with
``Serving.check_model`` and passes it to ``Serving.run_all``, which looks the adapter up
(``adapter_for``) as the request starts.
"""

from __future__ import annotations

import asyncio
import itertools
import json

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.lora.request import LoRARequest

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class ServedAdapters:
    """The adapters a server serves by name; loading one checks it against the model first."""

    def __init__(self, engine, base_name: str) -> None:
        self.engine, self.base_name = engine, base_name
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time: ids and names stay in step

    def get(self, name: str | None) -> LoRARequest | None:
        return self.by_name.get(name) if name is not None else None

    def load_now(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """Check and register an adapter (a ValueError, naming the problem, if it cannot be served)."""
        if not name or name == self.base_name:
            raise ValueError(f"an adapter's name must be new and not the base model's ({self.base_name!r})")
        if name in self.by_name and not replace:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded (load_inplace: true replaces it)")
        checked = self.engine.input_processor.adapters.check(LoRARequest(name, next(self._ids), path))
        self.by_name[name] = checked  # the swap: one assignment
        return checked

    async def load(self, name: str, path: str, replace: bool) -> LoRARequest:
        async with self._lock:  # the files are read off the event loop
            return await asyncio.to_thread(self.load_now, name, path, replace)

    async def unload(self, name: str) -> None:
        async with self._lock:
            if self.by_name.pop(name, None) is None:
                raise OpenAIError(f"the LoRA adapter {name!r} is not loaded", status=404, type_="NotFoundError",
                                  param="lora_name", code="lora_not_found")

    def model_cards(self, created: int, max_model_len: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "pagoda", "root": lora.lora_path,
                 "parent": self.base_name, "max_model_len": max_model_len} for name, lora in self.by_name.items()]


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules``' items, vLLM's two forms: ``name=path`` or JSON ``{"name": ..., "path": ...}``."""
    modules = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                modules.append((str(spec["name"]), str(spec["path"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {item!r}: JSON needs \"name\" and \"path\"") from None
        elif "=" in item:
            name, path = item.split("=", 1)
            modules.append((name.strip(), path.strip()))
        else:
            raise ValueError(f"--lora-modules {item!r}: give name=path or JSON {{\"name\": ..., \"path\": ...}}")
    return modules


def served_adapters(engine, base_name: str, lora_modules: list[str] | None) -> ServedAdapters | None:
    """The server's adapters, ``--lora-modules`` loaded (None without --enable-lora)."""
    modules = parse_lora_modules(lora_modules)
    if engine.config.lora is None:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    adapters = ServedAdapters(engine, base_name)
    for name, path in modules:
        adapters.load_now(name, path)
    return adapters


def _adapters(request: Request) -> ServedAdapters:
    adapters = request.app.state.serving.adapters
    if adapters is None:
        raise OpenAIError("this server serves no LoRA adapters: start it with --enable-lora", status=400,
                          param="lora_name", code="lora_disabled")
    return adapters


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    try:
        await _adapters(request).load(body.lora_name, body.lora_path, body.load_inplace)
    except ValueError as exc:
        raise OpenAIError(str(exc), param="lora_path", code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    await _adapters(request).unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
