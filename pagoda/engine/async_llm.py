"""AsyncLLM: the engine loop on its own thread, one asyncio stream per request.

The HTTP event loop never runs a model step, and a model step never waits for the event loop:
requests and aborts cross over through a thread-safe inbox, outputs come back with
`loop.call_soon_threadsafe`. A request whose consumer goes away (client disconnect, cancelled
task) is aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests cannot be served until the server restarts."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int


@dataclass
class _Abort:
    request_id: str


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
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

    # -- the HTTP side ----------------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield DELTA outputs for one request until it finishes; abort it if the caller stops."""
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running: {self.dead_error}")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, stream)
        self._inbox.put(_Add(request_id, prompt, params.clone(output_kind=RequestOutputKind.DELTA), priority))
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
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _handle(self, message) -> None:
        if isinstance(message, _Add):
            if message.request_id not in self._streams:
                return  # the caller left before the engine saw the request
            try:
                self.engine.add_request(message.request_id, message.prompt, message.params, priority=message.priority)
            except ValueError as e:
                self._deliver(message.request_id, e)
        elif isinstance(message, _Abort):
            self.engine.abort_request(message.request_id)

    def _drain_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while True:
            if message is None:
                return
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
        except BaseException as e:  # a failed step: fail every waiting request, mark unhealthy
            logger.exception("engine loop failed")
            self.dead_error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError(f"engine failure: {type(e).__name__}: {e}"))
