"""Several models in one server (`pagoda serve --model A --model B`, or `--models-file`): which
are loaded, loading on first use, unloading after `keep_alive` idle or to make room, as Ollama
does (docs/architecture.md, "Several models in one server").

Each model is a full single-model app (`api_server.build_app` over its own `AsyncLLM`); the
dispatcher (model_dispatch.py) asks the pool for the model a request names and runs the request
on that model's app. The pool's rules:

- **Lazy load.** A model loads when a request first names it (or at start-up with `preload`).
  Requests that arrive while it loads wait for the same load, up to `--load-timeout` seconds.
- **Room.** The loaded models' footprints (weights + KV cache, estimated from the files before
  loading) stay within `--models-memory` GiB and their number within `--max-loaded-models`. To
  load one more, idle models are unloaded least recently used first; a model with requests in
  flight is never unloaded: the load waits for one to finish (bounded by `--load-timeout`, then
  503). A model larger than the whole budget is refused at once.
- **keep_alive.** After its last request a model stays loaded for `keep_alive` seconds (the
  request's own, Ollama's API field; else the model's or `--keep-alive`, default 5 minutes);
  0 unloads it at once, a negative value keeps it loaded until the server stops.

Loads run one at a time (a lock), so the accounting of room is never raced; the engine work of
a load runs on a thread and the event loop keeps serving the other models meanwhile.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.entrypoints.app_memory import stop_and_release
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.served_models import DEFAULT_KEEP_ALIVE, FOREVER, ModelSpec
from pagoda.store.model_info import parameter_count

logger = logging.getLogger("pagoda.server")

GiB = 1 << 30


# -- what is served -------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    """A model that is loaded: its app, engine and the pool's bookkeeping."""

    spec: ModelSpec
    app: Any  # FastAPI app of build_app
    engine: Any  # AsyncLLM
    footprint: int  # bytes: weights + KV cache, as estimated
    load_seconds: float
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = DEFAULT_KEEP_ALIVE
    expires_at: float | None = None  # time.time() when it unloads if still idle; None: never / busy
    _timer: asyncio.TimerHandle | None = None

    @property
    def serving(self):
        return self.app.state.serving


# -- footprints ----------------------------------------------------------------------------------
def weight_bytes(config) -> int:
    """The bytes the model's weights take once loaded, from the files' headers (no tensor read):
    parameters x the size of the dtype, or of the ggml block for the quantized modes; a GGUF
    kept quantized takes its file's size."""
    mc = config.model
    files = mc.files
    if files.gguf_file and mc.quantization == "gguf":
        return Path(files.gguf_file).stat().st_size
    weights = [Path(files.gguf_file)] if files.gguf_file else sorted(Path(files.metadata_dir).glob("*.safetensors"))
    params = parameter_count(weights)
    per_param = {"int8": 34 / 32, "int4": 20 / 32}.get(mc.quantization or "", None)
    if per_param is None:
        per_param = mc.dtype.itemsize
    return int(params * per_param)


def kv_cache_bytes(config) -> int:
    """The KV cache's budget on the CPU (`--kv-cache-memory`, else the worker's default: 2 GiB or
    half of the free memory); on CUDA the engine takes a share of free memory instead, which this
    pool does not count."""
    from pagoda.platform import available_memory_bytes  # deferred: loads torch
    from pagoda.worker.kv_cache import cpu_budget_gib  # deferred: loads torch

    if config.model.device.type == "cuda":
        return 0
    return int(cpu_budget_gib(config.cache.kv_cache_memory_gib, available_memory_bytes(config.model.device)) * GiB)


def footprint_bytes(config) -> int:
    return weight_bytes(config) + kv_cache_bytes(config)


def format_gib(n: int) -> str:
    """Bytes as GiB for messages and logs."""
    return f"{n / GiB:.2f} GiB"


async def _run_hooks(hooks) -> None:
    """A model app's start-up or shutdown handlers: the pool runs them, since its apps are called
    from the front app's dispatcher and never see a lifespan of their own."""
    for hook in hooks:
        result = hook()
        if inspect.isawaitable(result):
            await result


# -- the pool ------------------------------------------------------------------------------------
class ModelPool:
    """The served models and the loaded ones (module docstring: the rules)."""

    def __init__(self, specs: list[ModelSpec], *, load: Callable[[ModelSpec], tuple[Any, Any]],
                 memory_budget: int, max_loaded: int, load_timeout: float, metrics=None) -> None:
        """``specs``: each with its EngineConfig resolved (the footprint is estimated from it);
        ``load(spec)`` builds (app, AsyncLLM), on a thread; ``metrics``: PoolMetrics."""
        names = [n for s in specs for n in s.names]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must differ, got {names}")
        self.specs = specs
        self._load_fn = load
        self.memory_budget, self.max_loaded, self.load_timeout = memory_budget, max_loaded, load_timeout
        self.metrics = metrics
        self.loaded: dict[str, LoadedModel] = {}  # by the spec's first name
        self._loading: dict[str, asyncio.Task] = {}
        self._room_lock = asyncio.Lock()  # one load (and its evictions) at a time
        self._released = asyncio.Condition()  # notified when a model's last request ends
        self._background: set[asyncio.Task] = set()  # fire-and-forget tasks, held until they end
        self.on_fatal: Callable[[BaseException], None] | None = None  # DrainingServer's, given to each engine
        self._closed = False

    # -- names -----------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [n for s in self.specs for n in s.names]

    def find(self, name: str | None) -> ModelSpec | None:
        """The spec a request's `model` names (Ollama's `:latest` suffix allowed)."""
        if not name:
            return None
        for candidate in dict.fromkeys((name, name.removesuffix(":latest"))):
            for spec in self.specs:
                if spec.accepts(candidate):
                    return spec
        return None

    def loaded_holding(self, predicate: Callable[[LoadedModel], bool]) -> LoadedModel | None:
        return next((m for m in self.loaded.values() if predicate(m)), None)

    # -- using a model ------------------------------------------------------------------------------
    async def acquire(self, spec: ModelSpec, keep_alive: float | None | str = "default") -> LoadedModel:
        """The loaded model, counted in flight until `release`; loads it first if needed."""
        model = self.loaded.get(spec.name)
        if model is None:
            model = await self._wait_loaded(spec)
        model.in_flight += 1
        model.last_used = time.monotonic()
        if model._timer is not None:
            model._timer.cancel()
            model._timer = None
        model.expires_at = None
        if keep_alive != "default":
            model.keep_alive = keep_alive
        return model

    def release(self, model: LoadedModel) -> None:
        model.in_flight -= 1
        model.last_used = time.monotonic()
        if model.in_flight > 0 or self.loaded.get(model.spec.name) is not model:
            return
        self._schedule_expiry(model)
        self._spawn(self._notify_released())

    def _spawn(self, coro) -> None:
        """Run ``coro`` in the background. The loop keeps only a weak reference to a task, so an
        unreferenced one may be collected before it runs to its end: the pool holds it until then."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _notify_released(self) -> None:
        async with self._released:
            self._released.notify_all()

    def _schedule_expiry(self, model: LoadedModel) -> None:
        if model.keep_alive is FOREVER:
            model.expires_at = None
            return
        model.expires_at = time.time() + model.keep_alive
        loop = asyncio.get_running_loop()
        model._timer = loop.call_later(model.keep_alive, lambda: self._spawn(self._expire(model)))

    async def _expire(self, model: LoadedModel) -> None:
        model._timer = None
        if model.in_flight == 0 and self.loaded.get(model.spec.name) is model:
            async with self._room_lock:
                if model.in_flight == 0 and self.loaded.get(model.spec.name) is model:
                    await self._unload(model, "keep_alive")

    async def unload_now(self, spec: ModelSpec) -> bool:
        """Ollama's `keep_alive: 0` on an empty request: unload now if idle; whether it was."""
        model = self.loaded.get(spec.name)
        if model is None:
            return True
        async with self._room_lock:
            if model.in_flight == 0 and self.loaded.get(spec.name) is model:
                await self._unload(model, "request")
                return True
        model.keep_alive = 0.0  # busy: it unloads when its last request ends
        return False

    # -- loading -------------------------------------------------------------------------------------
    async def _wait_loaded(self, spec: ModelSpec) -> LoadedModel:
        task = self._loading.get(spec.name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(spec))
            self._loading[spec.name] = task
            task.add_done_callback(lambda t: (self._loading.pop(spec.name, None), t.cancelled() or t.exception()))
        try:
            # the room's own deadline (load_timeout) answers first, with what kept the room busy
            return await asyncio.wait_for(asyncio.shield(task), self.load_timeout + 1.0)
        except TimeoutError:
            raise OpenAIError(f"the model `{spec.name}` did not load within {self.load_timeout:g} s "
                              "(--load-timeout); retry later", status=503, type_="server_error",
                              code="model_load_timeout", headers={"Retry-After": "5"}) from None

    async def preload(self) -> None:
        for spec in self.specs:
            if spec.preload:
                model = await self._wait_loaded(spec)
                if model.in_flight == 0 and model._timer is None:  # no request yet: it still expires
                    self._schedule_expiry(model)

    async def _load(self, spec: ModelSpec) -> LoadedModel:
        if self._closed:
            raise OpenAIError("the server is shutting down", status=503, type_="server_error", code="shutting_down")
        need = footprint_bytes(spec.config)
        if need > self.memory_budget:
            weights, kv = format_gib(weight_bytes(spec.config)), format_gib(kv_cache_bytes(spec.config))
            raise OpenAIError(
                f"the model `{spec.name}` needs about {format_gib(need)} (weights {weights} + KV cache {kv}), more "
                f"than --models-memory {format_gib(self.memory_budget)}; "
                "give the server more memory or the model a smaller --kv-cache-memory", status=503,
                type_="server_error", code="insufficient_memory")
        deadline = time.monotonic() + self.load_timeout
        async with self._room_lock:
            await self._make_room(spec, need, deadline)
            started = time.monotonic()
            logger.info("loading %s (about %s)", spec.name, format_gib(need))
            app, engine = await asyncio.to_thread(self._load_fn, spec)
            engine.on_fatal = self.on_fatal
            await _run_hooks(app.router.on_startup)  # the app's own start-up hooks (sessions' sweeper)
            seconds = time.monotonic() - started
            model = LoadedModel(spec, app, engine, need, seconds, keep_alive=spec.keep_alive)
            self.loaded[spec.name] = model
            if self.metrics is not None:
                self.metrics.loaded(spec.name, seconds)
            logger.info("loaded %s in %.2f s (%d loaded, %s of %s)", spec.name, seconds, len(self.loaded),
                        format_gib(self.used_memory), format_gib(self.memory_budget))
        # No expiry timer yet: the requests waiting for this load take it first (a keep_alive of 0
        # would otherwise unload it before they run); the last one's release starts the timer.
        return model

    @property
    def used_memory(self) -> int:
        return sum(m.footprint for m in self.loaded.values())

    async def _make_room(self, spec: ModelSpec, need: int, deadline: float) -> None:
        """Unload idle models, least recently used first, until `spec` fits; wait for busy ones
        to finish (the room lock is let go meanwhile) until the deadline."""
        while True:
            while not self._fits(need):
                idle = sorted((m for m in self.loaded.values() if m.in_flight == 0), key=lambda m: m.last_used)
                if not idle:
                    break
                await self._unload(idle[0], "memory")
            if self._fits(need):
                return
            left = deadline - time.monotonic()
            busy = ", ".join(f"`{m.spec.name}` ({m.in_flight} in flight)" for m in self.loaded.values())
            if left <= 0:
                raise OpenAIError(f"no room to load `{spec.name}` (about {format_gib(need)}): {busy} are busy within "
                                  f"--models-memory {format_gib(self.memory_budget)} / --max-loaded-models "
                                  f"{self.max_loaded}; retry later", status=503, type_="server_error",
                                  code="models_busy", headers={"Retry-After": "5"})
            logger.info("waiting for room to load %s: %s", spec.name, busy)
            self._room_lock.release()
            try:
                async with self._released:
                    try:
                        await asyncio.wait_for(self._released.wait(), left)
                    except TimeoutError:
                        pass
            finally:
                await self._room_lock.acquire()

    def _fits(self, need: int) -> bool:
        return len(self.loaded) < self.max_loaded and self.used_memory + need <= self.memory_budget

    async def _unload(self, model: LoadedModel, reason: str) -> None:
        """Stop a model's engine and drop it (the room lock is held)."""
        name = model.spec.name
        self.loaded.pop(name, None)
        if model._timer is not None:
            model._timer.cancel()
        model.expires_at = None
        await _run_hooks(model.app.router.on_shutdown)
        await asyncio.sleep(0)  # a task a hook cancelled (the sessions' sweeper) ends, and lets go of the app
        model.serving.metrics.close()
        await asyncio.to_thread(stop_and_release, model)  # the engine stopped, its memory given back
        if self.metrics is not None:
            self.metrics.unloaded(name, reason)
        logger.info("unloaded %s (%s)", name, reason)

    # -- the server's view of all engines (DrainingServer) ------------------------------------------
    @property
    def num_pending(self) -> int:
        return sum(m.engine.num_pending for m in self.loaded.values())

    def abort_all(self, error: BaseException) -> int:
        return sum(m.engine.abort_all(error) for m in list(self.loaded.values()))

    def shutdown(self) -> None:
        """Stop every engine (the server is stopping; its event loop is gone)."""
        self._closed = True
        for model in list(self.loaded.values()):
            model.engine.shutdown()
        self.loaded.clear()

    async def close(self) -> None:
        """The apps' shutdown hooks, while the event loop still runs."""
        self._closed = True
        for model in list(self.loaded.values()):
            await _run_hooks(model.app.router.on_shutdown)


class PoolMetrics:
    """The pool's Prometheus series on the server's shared registry: loads and their time,
    unloads by reason, and which models are loaded now."""

    def __init__(self, families, pool_ref: Callable[[], ModelPool | None]) -> None:
        from prometheus_client import Counter, Histogram  # deferred: prometheus_client loads on first use
        from prometheus_client.core import GaugeMetricFamily  # deferred: prometheus_client loads on first use

        registry = families.registry
        self.loads = Counter("pagoda:model_loads", "Models loaded (on first use, or again after an unload).",
                             ["model_name"], registry=registry)
        self.load_seconds = Histogram("pagoda:model_load_seconds", "Time to load a model (engine start included).",
                                      ["model_name"], buckets=(0.5, 1, 2, 5, 10, 20, 40, 80, 160), registry=registry)
        self.unloads = Counter("pagoda:model_unloads", "Models unloaded, by reason: keep_alive (idle), memory "
                               "(room for another model) or request (keep_alive 0).", ["model_name", "reason"],
                               registry=registry)

        class _Loaded:
            def collect(self):
                g = GaugeMetricFamily("pagoda:model_loaded", "1 while the model is loaded, else 0.",
                                      labels=["model_name"])
                pool = pool_ref()
                for spec in pool.specs if pool is not None else ():
                    g.add_metric([spec.name], 1.0 if spec.name in pool.loaded else 0.0)
                yield g
                g = GaugeMetricFamily("pagoda:model_memory_bytes", "Estimated memory of the loaded model "
                                      "(weights + KV cache).", labels=["model_name"])
                for model in pool.loaded.values() if pool is not None else ():
                    g.add_metric([model.spec.name], model.footprint)
                yield g

        registry.register(_Loaded())

    def loaded(self, name: str, seconds: float) -> None:
        self.loads.labels(name).inc()
        self.load_seconds.labels(name).observe(seconds)

    def unloaded(self, name: str, reason: str) -> None:
        self.unloads.labels(name, reason).inc()
