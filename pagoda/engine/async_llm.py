"""AsyncLLM: the model steps on their own thread; everything with text stays on the event loop.

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
import itertools
import logging
from collections.abc import AsyncIterator, Callable

from pagoda.engine.core import EngineCoreOutput
from pagoda.engine.core_client import ProcessCoreClient, ThreadCoreClient
from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.executor.base import WorkerFailedError
from pagoda.outputs import RequestOutput
from pagoda.request import RequestStatus
from pagoda.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """A request cannot be served now (HTTP 503): the engine failed or the server is stopping."""


class EngineDeadError(EngineUnavailableError):
    """The engine loop failed; requests cannot be served until it is restarted."""


class ShuttingDownError(EngineUnavailableError):
    """The server is shutting down: its drain period ended before this request finished."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine, *, engine_process: bool = False, max_engine_restarts: int = 0) -> None:
        """engine_process=True runs the core in its own process (`engine` must then be built
        with build_core=False), restarted up to max_engine_restarts times if it dies; otherwise
        it runs on a thread of this process, built there if `engine` has none yet (the server's
        way: see ThreadCoreClient)."""
        self.engine = engine
        self.output_processor = engine.output_processor  # used on the event loop only
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called on the event loop when the engine cannot go on and will not be restarted (a
        # tensor-parallel worker died): the server then stops (run_server).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._debug_queries: dict[int, asyncio.Future] = {}  # debug snapshots asked of the engine
        self._query_ids = itertools.count()
        if engine_process:
            self.client = ProcessCoreClient(engine.config, self._from_core, self._core_failed,
                                            max_restarts=max_engine_restarts, on_answer=self._debug_answered)
            engine.limits = self.client.limits
        else:  # an engine built without its core has it built on the engine's thread (ThreadCoreClient)
            core_or_config = engine.core if engine.core is not None else engine.config
            self.client = ThreadCoreClient(core_or_config, self._from_core, self._core_failed,
                                           on_answer=self._debug_answered)
            engine.core, engine.limits = self.client.core, self.client.limits

    @property
    def healthy(self) -> bool:
        return self.client.healthy

    @property
    def dead_error(self) -> BaseException | None:
        return self.client.dead_error

    @property
    def restarting(self) -> bool:
        """True while a replacement engine process is loading."""
        return getattr(self.client, "restarting", False)

    @property
    def limits(self):
        return self.client.limits

    def stats(self):
        return self.client.stats()

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    # -- the event-loop side ----------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, cache_salt: str | None = None,
                       session_id: str | None = None, moderation=None) -> AsyncIterator[RequestOutput]:
        """Yield DELTA outputs for one request until it finishes; abort it if the caller stops.
        `moderation` (pagoda.engine.content_filter.Moderation) filters its output text."""
        if not self.healthy:
            state = "restarting" if self.restarting else f"not running: {self.dead_error}"
            raise EngineDeadError(f"the engine is {state}")
        self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params.clone(output_kind=RequestOutputKind.DELTA)
        prepared = self.engine.prepare_request(request_id, prompt, params, priority, cache_salt=cache_salt,
                                               session_id=session_id)  # may raise ValueError
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self.output_processor.add_request(*prepared.output_args(), moderation=moderation)
        self.client.add(prepared.core_requests)
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
                self._abort(request_id)

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

    def _abort(self, request_id: str) -> None:
        core_ids = self.output_processor.core_ids(request_id)
        self.output_processor.abort_request(request_id)
        if core_ids:
            self.client.finish(core_ids, RequestStatus.FINISHED_ABORTED)

    def _on_core_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Runs on the event loop: detokenize, apply stop strings, hand out the deltas."""
        results, to_stop = self.output_processor.process_outputs(outputs)
        if to_stop:
            self.client.finish(to_stop, RequestStatus.FINISHED_STOPPED)
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _on_failure(self, error: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            self.output_processor.abort_request(rid)
            stream.put_nowait(error)
        for answer in self._debug_queries.values():
            if not answer.done():
                answer.set_exception(error)

    def abort_all(self, error: BaseException) -> int:
        """End every request in flight with `error` (raised in its consumer) and free its KV
        blocks; returns how many were ended. Call on the event loop (shutdown's drain deadline)."""
        streams = list(self._streams.items())
        for rid, stream in streams:
            self._abort(rid)
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
            if isinstance(error, WorkerFailedError) and self.on_fatal is not None:
                self._loop.call_soon_threadsafe(self.on_fatal, error)

    def shutdown(self) -> None:
        """Stop the engine and let go of its core (model, KV cache): whatever still holds this
        AsyncLLM after a server unloaded its model (a task not yet ended, a framework's cache)
        then holds its tokenizer, not its weights."""
        self.client.shutdown()
        self.engine.core = None
