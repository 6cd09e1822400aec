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
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagoda.engine.core import EngineCoreOutput
from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.outputs import RequestOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests cannot be served until the server restarts."""


@dataclass
class _Add:
    request_id: str
    requests: list[Request]


@dataclass
class _Stop:
    core_ids: list[str]
    status: RequestStatus


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.core = engine.core
        self.output_processor = engine.output_processor  # used on the event loop only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    # -- the event-loop side ----------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield DELTA outputs for one request until it finishes; abort it if the caller stops."""
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running: {self.dead_error}")
        self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params.clone(output_kind=RequestOutputKind.DELTA)
        prepared = self.engine.prepare_request(request_id, prompt, params, priority)  # raises ValueError
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self.output_processor.add_request(*prepared.output_args())
        self._inbox.put(_Add(request_id, prepared.core_requests))
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

    def _abort(self, request_id: str) -> None:
        core_ids = self.output_processor.core_ids(request_id)
        self.output_processor.abort_request(request_id)
        if core_ids:
            self._inbox.put(_Stop(core_ids, RequestStatus.FINISHED_ABORTED))

    def _on_core_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Runs on the event loop: detokenize, apply stop strings, hand out the deltas."""
        results, to_stop = self.output_processor.process_outputs(outputs)
        if to_stop:
            self._inbox.put(_Stop(to_stop, RequestStatus.FINISHED_STOPPED))
        for out in results:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _on_failure(self, error: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            self.output_processor.abort_request(rid)
            stream.put_nowait(error)

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------
    def _handle(self, message) -> None:
        if isinstance(message, _Add):
            for request in message.requests:
                self.core.add_request(request)  # validated on the loop side already
        elif isinstance(message, _Stop):
            self.core.finish_requests(message.core_ids, message.status)

    def _drain_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while message is not None:
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox(block=not self.core.has_unfinished_requests())
                if self.core.has_unfinished_requests():
                    outputs = self.core.step()
                    if outputs and self._loop is not None:
                        self._loop.call_soon_threadsafe(self._on_core_outputs, outputs)
        except BaseException as e:
            logger.exception("engine loop failed")
            self.dead_error = e
            if self._loop is not None:
                error = EngineDeadError(f"engine failure: {type(e).__name__}: {e}")
                self._loop.call_soon_threadsafe(self._on_failure, error)
