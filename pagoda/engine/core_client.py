"""Where the EngineCore runs for the server: a thread of this process, or a process of its own.

Both clients take core requests and stop orders from the event loop and report each step's
outputs (and failures) through callbacks that they call from a background thread. The thread
client shares the GIL with the HTTP loop but costs no copies; the process client has its own
interpreter and pays for pickling requests and outputs through queues.
"""

from __future__ import annotations

import logging
import os
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable

from pagoda.config import EngineConfig
from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.core import EngineCore, EngineCoreOutput, RequestLimits
from pagoda.request import Request, RequestStatus

logger = logging.getLogger(__name__)

OnOutputs = Callable[[list[EngineCoreOutput]], None]
OnFailure = Callable[[BaseException], None]


def _serve_core(core: EngineCore, inbox, emit_outputs: Callable[[list[EngineCoreOutput]], None],
                stopped: Callable[[], bool]) -> None:
    """The step loop shared by both clients: drain orders, step while anything is unfinished.

    emit_outputs gets each step's outputs, and an empty list when orders left the core idle
    (so a remote client's stats see aborts that no step reports)."""
    while not stopped():
        handled = False
        block = not core.has_unfinished_requests()
        try:
            message = inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            message = ()
        while message != ():
            if message is None:
                return
            handled = True
            kind, payload, status = message
            if kind == "add":
                for request in payload:
                    core.add_request(request)
            else:
                core.finish_requests(payload, status)
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = ()
        if core.has_unfinished_requests():
            emit_outputs(core.step())
        elif handled:
            emit_outputs([])


class _InboxClient:
    """What both clients share: orders go to the core's loop through an inbox queue."""

    _inbox: queue.SimpleQueue

    def add(self, requests: list[Request]) -> None:
        self._inbox.put(("add", requests, None))

    def finish(self, core_ids: list[str], status: RequestStatus) -> None:
        self._inbox.put(("finish", core_ids, status))


class ThreadCoreClient(_InboxClient):
    def __init__(self, core: EngineCore, on_outputs: OnOutputs, on_failure: OnFailure) -> None:
        self.core = core
        self.limits: RequestLimits = core.limits
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self.dead_error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            _serve_core(self.core, self._inbox, lambda outs: outs and self._on_outputs(outs), lambda: self._stopped)
        except BaseException as e:
            logger.exception("engine loop failed")
            self.dead_error = e
            self._on_failure(e)


def _process_main(config: EngineConfig, inbox, outbox, parent_pid: int) -> None:
    """Entry point of the engine process. It stops when told to, or when the server process is
    gone (killed, or stopped by a signal that skipped shutdown): an orphan would hold the model
    and the KV cache forever."""
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        outbox.put(("failed", f"{type(e).__name__}: {e}", None))
        return
    outbox.put(("ready", core.limits, core.stats()))
    try:
        _serve_core(core, inbox, lambda outs: outbox.put(("outputs", outs, core.stats())),
                    lambda: os.getppid() != parent_pid)
        outbox.put(("stopped", None, None))
    except BaseException as e:  # noqa: BLE001
        outbox.put(("failed", f"{type(e).__name__}: {e}", None))


class ProcessCoreClient(_InboxClient):
    def __init__(self, config: EngineConfig, on_outputs: OnOutputs, on_failure: OnFailure) -> None:
        ctx = mp.get_context("spawn")  # no fork after torch has started its thread pools
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=_process_main, args=(config, self._inbox, self._outbox, os.getpid()),
                                 name="pagoda-engine", daemon=True)
        self._proc.start()
        kind, payload, stats = self._outbox.get()
        if kind != "ready":
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.limits: RequestLimits = payload
        self._stats: SchedulerStats = stats
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self.dead_error: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="pagoda-engine-reader", daemon=True)
        self._reader.start()

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and self._proc.is_alive()

    def stats(self) -> SchedulerStats:
        return self._stats

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()

    def _read(self) -> None:
        while True:
            try:
                kind, payload, stats = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    self._fail(RuntimeError(f"the engine process exited (code {self._proc.exitcode})"))
                    return
                continue
            if kind == "outputs":
                self._stats = stats
                if payload:
                    self._on_outputs(payload)
            elif kind == "failed":
                self._fail(RuntimeError(payload))
                return
            elif kind == "stopped":
                return

    def _fail(self, error: BaseException) -> None:
        logger.error("engine process failed: %s", error)
        self.dead_error = error
        self._on_failure(error)
