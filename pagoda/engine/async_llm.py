"""AsyncLLM: the model steps on their own thread; everything with text stays on the event loop.

A sibling of LLMEngine over the same front end (engine/front_end.py: one input path, one output
path, stop strings in the output path).

The engine thread owns the EngineCore (scheduler, KV cache, model) and does nothing but run
steps. The asyncio side owns the rest: tokenizing and validating new requests, detokenizing,
stop strings and logprob formatting (the OutputProcessor), and one queue per request. So
accepting requests, tokenizing and detokenizing never delay a model step, and a model step
never blocks the HTTP loop. The two sides talk through a thread-safe inbox (add / abort /
finish core requests) and `loop.call_soon_threadsafe` (core outputs, failures).

A request whose consumer goes away (client disconnect, cancelled task) is aborted, which frees
its KV blocks. If a step raises, every request in flight fails and `healthy` turns False.
One AsyncLLM serves one event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable

from pagoda.config import EngineConfig
from pagoda.engine.core import EngineCore, EngineCoreOutput
from pagoda.engine.core_client import ProcessCoreClient, ThreadCoreClient
from pagoda.engine.front_end import FrontEnd
from pagoda.engine.input_processor import PromptType
from pagoda.lora.request import LoRARequest
from pagoda.executor.base import WorkerFailedError
from pagoda.models.layer_readiness import LoadFailed
from pagoda.outputs import PoolingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """A request cannot be served now (HTTP 503): the engine failed or the server is stopping."""


class EngineDeadError(EngineUnavailableError):
    """The engine loop failed; requests cannot be served until it is restarted."""


class ShuttingDownError(EngineUnavailableError):
    """The server is shutting down: its drain period ended before this request finished."""


class AsyncLLM(FrontEnd):
    def __init__(self, config: EngineConfig, *, engine_process: bool = False, max_engine_restarts: int = 0) -> None:
        """engine_process=True runs the core in its own process, restarted up to
        max_engine_restarts times if it dies; otherwise on a thread of this process, built there
        (see ThreadCoreClient)."""
        if engine_process and config.progressive_load:  # /health could not see the progress in the other process
            logger.info("progressive loading off: the engine runs in its own process (--engine-process)")
            config = dataclasses.replace(config, progressive_load=False)
        super().__init__(config)
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called on the event loop when the engine cannot go on and will not be restarted (a
        # tensor-parallel worker died): the server then stops (run_server).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._debug_queries: dict[int, asyncio.Future] = {}  # debug snapshots asked of the engine
        self._query_ids = itertools.count()
        if engine_process:
            self._connect(ProcessCoreClient(config, self._from_core, self._core_failed,
                                            max_restarts=max_engine_restarts, on_answer=self._debug_answered))
        else:
            self._connect(ThreadCoreClient(config, self._from_core, self._core_failed,
                                           on_answer=self._debug_answered))

    @property
    def core(self) -> EngineCore | None:
        """The core when it runs on this process's thread (None in an engine process)."""
        return getattr(self.client, "core", None)

    @property
    def healthy(self) -> bool:
        return self.client.healthy

    def loading_progress(self) -> dict | None:
        """How far the model loading layer by layer is (models/layer_readiness.py), or None when it
        loaded whole; an engine process loads whole (its progress would not reach this side)."""
        core = self.core
        return core.loading_progress() if core is not None else None

    def wait_until_loaded(self) -> None:
        """Block until the model is all in place (the loader's error if its load failed); at once
        when it loaded whole."""
        core = self.core
        if core is not None:
            core.wait_until_loaded()

    @property
    def dead_error(self) -> BaseException | None:
        return self.client.dead_error

    @property
    def restarting(self) -> bool:
        """True while a replacement engine process is loading."""
        return getattr(self.client, "restarting", False)

    def stats(self):
        return self.client.stats()

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    # -- the event-loop side ----------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, cache_salt: str | None = None,
                       session_id: str | None = None, moderation=None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield DELTA outputs for one request until it finishes; abort it if the caller stops.
        `moderation` (pagoda.engine.content_filter.Moderation) filters its output text;
        `lora_request` names the LoRA adapter it runs under."""
        self._check_request(request_id, "generate")
        params = params.clone(output_kind=RequestOutputKind.DELTA)
        prepared = self.input_processor.prepare_request(request_id, prompt, params, priority, cache_salt=cache_salt,
                                                        session_id=session_id,
                                                        lora_request=lora_request)  # may raise ValueError
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self.submit(prepared, moderation)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def encode(self, prompt: PromptType, params: PoolingParams, request_id: str,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request (the pooling runner's, vLLM's ``encode``): yields its one output,
        the vector, when its prompt has run; aborted if the caller stops first."""
        self._check_request(request_id, "pooling")
        prepared = self.prepare_pooling(request_id, prompt, params, priority)  # may raise ValueError
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self.submit_pooling(prepared)
        finished = False
        try:
            item = await stream.get()  # its one output
            if isinstance(item, BaseException):
                raise item
            finished = True
            if item.outputs is None:
                raise EngineDeadError(f"request {request_id} was aborted")
            yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _check_request(self, request_id: str, runner: str) -> None:
        """A new request may start: the engine is up, runs its kind, and its id is free."""
        if not self.healthy:
            state = "restarting" if self.restarting else f"not running: {self.dead_error}"
            raise EngineDeadError(f"the engine is {state}")
        self.check_runner(runner)
        self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")

    def release_sessions(self, session_ids: list[str]) -> None:
        """Sessions that ended: the core lets their pinned prefixes go."""
        if session_ids and self.healthy:
            self.client.release_sessions(session_ids)

    async def debug(self, what: str, limit: int | None = None, timeout: float = 10.0) -> dict:
        """A snapshot of the engine's recorder (engine/step_trace.py; `what`: engine, steps,
        requests, radix or all), built by the engine between two steps, in either engine mode."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        self._loop = self._loop or loop
        query_id = next(self._query_ids)
        answer = self._debug_queries[query_id] = loop.create_future()
        self.client.debug(query_id, what, limit)
        try:
            return await asyncio.wait_for(answer, timeout)
        finally:
            self._debug_queries.pop(query_id, None)

    def _on_debug_answer(self, query_id: int, snapshot: dict | None, error: str | None) -> None:
        answer = self._debug_queries.get(query_id)
        if answer is None or answer.done():
            return
        if error is not None:
            answer.set_exception(ValueError(error))
        else:
            answer.set_result(snapshot)

    def _on_core_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Runs on the event loop: detokenize, apply stop strings, hand out the deltas."""
        for out in self.take_outputs(outputs):
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _on_failure(self, error: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            self.output_processor.abort_request(rid)
            self.pooling_requests.pop(rid, None)
            stream.put_nowait(error)
        for answer in self._debug_queries.values():
            if not answer.done():
                answer.set_exception(error)

    def abort_all(self, error: BaseException) -> int:
        """End every request in flight with `error` (raised in its consumer) and free its KV
        blocks; returns how many were ended. Call on the event loop (shutdown's drain deadline)."""
        streams = list(self._streams.items())
        for rid, stream in streams:
            self.abort(rid)
            stream.put_nowait(error)
        return len(streams)

    # -- called from the client's background thread ------------------------------------------
    def _from_core(self, outputs: list[EngineCoreOutput]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_core_outputs, outputs)

    def _debug_answered(self, query_id: int, snapshot: dict | None, error: str | None) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_debug_answer, query_id, snapshot, error)

    def _core_failed(self, error: BaseException) -> None:
        if self._loop is not None:
            wrapped = EngineDeadError(f"engine failure: {type(error).__name__}: {error}")
            self._loop.call_soon_threadsafe(self._on_failure, wrapped)
            if isinstance(error, (WorkerFailedError, LoadFailed)) and self.on_fatal is not None:
                self._loop.call_soon_threadsafe(self.on_fatal, error)

    def watch_failures(self, loop: asyncio.AbstractEventLoop) -> None:
        """Report engine failures on ``loop`` from now on (requests also set it); a model that
        already failed to load is reported at once."""
        self._loop = self._loop or loop
        if isinstance(self.client.dead_error, LoadFailed):
            self._core_failed(self.client.dead_error)

    def shutdown(self) -> None:
        """Stop the engine and let go of its core (model, KV cache): whatever still holds this
        AsyncLLM after a server unloaded its model (a task not yet ended, a framework's cache)
        then holds its tokenizer, not its weights."""
        self.client.shutdown()
