"""Where the EngineCore runs for the server: a thread of this process, or a process of its own.

Both clients take core requests and stop orders from the event loop and report each step's
outputs (and failures) through callbacks that they call from a background thread. The thread
client shares the GIL with the HTTP loop but costs no copies; the process client has its own
interpreter and pays for pickling requests and outputs through queues.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import wait
import os
import multiprocessing as mp
import queue
import signal
import threading
from collections.abc import Callable

from pagoda.config import EngineConfig
from pagoda.core.scheduler_stats import SchedulerStats
from pagoda.engine.core import EngineCore, EngineCoreOutput, RequestLimits
from pagoda.models.layer_readiness import LoadFailed
from pagoda.engine.core_messages import (
    AddRequests, DebugAnswer, DebugQuery, EngineFailed, EngineReady, EngineStopped, FinishRequests,
    FromCore, ReleaseSessions, Shutdown, StepOutputs, ToCore,
)
from pagoda.request import EngineCoreRequest, RequestStatus

logger = logging.getLogger(__name__)

OnOutputs = Callable[[list[EngineCoreOutput]], None]
OnFailure = Callable[[BaseException], None]
# A debug query's answer: (query id, the snapshot, or the error text when it failed)
OnAnswer = Callable[[int, dict | None, str | None], None]


def _answer_debug(core: EngineCore, query: DebugQuery, answer: OnAnswer) -> None:
    """Build a recorder snapshot (engine/step_trace.py) between steps, where nothing changes it."""
    try:
        snapshot = core.debug_snapshot(query.what, query.limit)
    except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
        answer(query.query_id, None, f"{type(e).__name__}: {e}")
    else:
        answer(query.query_id, snapshot, None)


def _serve_core(core: EngineCore, inbox, emit_outputs: Callable[[list[EngineCoreOutput]], None],
                stopped: Callable[[], bool], answer: OnAnswer) -> None:
    """The step loop shared by both clients: drain orders, step while anything is unfinished.

    emit_outputs gets each step's outputs, and an empty list when orders left the core idle
    (so a remote client's stats see aborts that no step reports). Debug queries are answered
    through `answer` between steps."""
    while not stopped():
        core.check_health()  # a dead tensor-parallel worker fails the engine even while it idles
        handled = False
        block = not core.has_unfinished_requests()
        try:
            message: ToCore | None = inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            message = None
        while message is not None:
            handled = True
            match message:
                case Shutdown():
                    return
                case AddRequests(requests):
                    for request in requests:
                        core.add_request(request)
                case FinishRequests(request_ids, status):
                    core.finish_requests(request_ids, status)
                case ReleaseSessions(session_ids):
                    core.release_sessions(session_ids)
                case DebugQuery():
                    _answer_debug(core, message, answer)
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = None
        if core.has_unfinished_requests():
            emit_outputs(core.step())
        elif handled:
            emit_outputs([])


class InprocCoreClient:
    """The EngineCore in the caller's thread, stepped by the caller (LLMEngine's loop)."""

    healthy = True

    def __init__(self, config: EngineConfig) -> None:
        self.core: EngineCore | None = EngineCore(config)
        self.limits: RequestLimits = self.core.limits

    def add(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.core.add_request(request)

    def finish(self, core_ids: list[str], status: RequestStatus) -> None:
        self.core.finish_requests(core_ids, status)

    def release_sessions(self, session_ids: list[str]) -> None:
        self.core.release_sessions(session_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()


class _InboxClient:
    """What both clients share: orders go to the core's loop through an inbox queue."""

    _inbox: queue.SimpleQueue

    def add(self, requests: list[EngineCoreRequest]) -> None:
        self._inbox.put(AddRequests(requests))

    def finish(self, core_ids: list[str], status: RequestStatus) -> None:
        self._inbox.put(FinishRequests(core_ids, status))

    def release_sessions(self, session_ids: list[str]) -> None:
        self._inbox.put(ReleaseSessions(session_ids))

    def debug(self, query_id: int, what: str, limit: int | None = None) -> None:
        """Ask for a recorder snapshot; it comes back through the client's `on_answer`."""
        self._inbox.put(DebugQuery(query_id, what, limit))


class ThreadCoreClient(_InboxClient):
    """The EngineCore on a thread of this process.

    It builds the core on that thread, so that the thread running the model is the only one in
    the process that ever leads an OpenMP team. libgomp cuts every thread's spin after a parallel region to 100
    iterations once a process holds more OpenMP threads than CPUs; a model loaded on the main
    thread left a second, idle team there (more threads than cores), so the engine's threads
    slept and were woken around each of a step's parallel regions, which cost one stream about
    a third of its speed (benchmarks/README.md, "One stream through every path")."""

    def __init__(self, config: EngineConfig, on_outputs: OnOutputs, on_failure: OnFailure,
                 on_answer: OnAnswer | None = None) -> None:
        self.core: EngineCore | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._on_answer = on_answer or (lambda *_: None)
        self.dead_error: BaseException | None = None
        self._stopped = False
        self._built = threading.Event()
        self._final_stats: SchedulerStats | None = None  # stats() once shut down
        self._thread = threading.Thread(target=self._run, args=(config,), name="pagoda-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self.core is None:  # the build failed on the thread: fail here, as building it here would
            raise self.dead_error
        self.limits: RequestLimits = self.core.limits

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def _load_failed(self, error: BaseException) -> None:
        """The loader's thread failed (loader/progressive_load.py): the engine cannot serve."""
        if self._stopped or self.dead_error is not None:
            return
        self.dead_error = LoadFailed(f"loading the model failed: {type(error).__name__}: {error}")
        self._on_failure(self.dead_error)

    def stats(self) -> SchedulerStats:
        return self.core.stats() if self.core is not None else self._final_stats

    def shutdown(self) -> None:
        """Stop the loop and let go of the core (the model and the KV cache): what still holds
        this client then holds no more than its last stats."""
        self._stopped = True
        self._inbox.put(Shutdown())
        self._thread.join(timeout=10)
        core, self.core = self.core, None
        if core is not None:  # not stopped before
            self._final_stats = core.stats()
            core.shutdown()  # the workers of other ranks, if any

    def _run(self, config: EngineConfig) -> None:
        try:
            self.core = EngineCore(config)
        except BaseException as e:  # noqa: BLE001 - raised again by __init__
            self.dead_error = e
            return
        finally:
            self._built.set()
        readiness = self.core.executor.driver_worker.readiness
        if readiness is not None:  # loading layer by layer: a failed load ends the engine as a failed step would
            readiness.when_failed(self._load_failed)
        try:
            _serve_core(self.core, self._inbox, lambda outs: outs and self._on_outputs(outs), lambda: self._stopped,
                        self._on_answer)
        except BaseException as e:
            logger.exception("engine loop failed")
            self.dead_error = e
            self._on_failure(e)


def _process_main(config: EngineConfig, inbox, outbox, parent_pid: int) -> None:
    """Entry point of the engine process. It stops when told to, or when the server process is
    gone (killed, or stopped by a signal that skipped shutdown): an orphan would hold the model
    and the KV cache forever.

    It ignores SIGINT and SIGTERM: a terminal's Ctrl-C and a service manager's SIGTERM reach the
    whole process group, and the server, not the engine, decides when to stop (after draining)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        outbox.put(EngineFailed(f"{type(e).__name__}: {e}"))
        return
    outbox.put(EngineReady(core.limits, core.stats()))
    try:
        _serve_core(core, inbox, lambda outs: outbox.put(StepOutputs(outs, core.stats())),
                    lambda: os.getppid() != parent_pid,
                    lambda query_id, snapshot, error: outbox.put(DebugAnswer(query_id, snapshot, error)))
        outbox.put(EngineStopped())
    except BaseException as e:  # noqa: BLE001
        outbox.put(EngineFailed(f"{type(e).__name__}: {e}"))
    finally:
        core.shutdown()


class ProcessCoreClient(_InboxClient):
    """The EngineCore in a spawned process, restarted (up to `max_restarts` times) when it dies.

    A dead engine fails every request in flight at once (the reader thread watches the process's
    sentinel, not a timeout); while the replacement loads, `healthy` is False and new requests
    are refused. Each engine process gets fresh queues: one killed while holding a queue's lock
    would leave that queue unusable."""

    def __init__(self, config: EngineConfig, on_outputs: OnOutputs, on_failure: OnFailure,
                 max_restarts: int = 0, on_answer: OnAnswer | None = None) -> None:
        self._config = config
        self._ctx = mp.get_context("spawn")  # no fork after torch has started its thread pools
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._on_answer = on_answer or (lambda *_: None)
        self.max_restarts, self.num_restarts = max_restarts, 0
        self.dead_error: BaseException | None = None
        self.restarting = False
        self._closing = False
        self._start_process()  # raises if the first engine cannot start
        self._reader = threading.Thread(target=self._read, name="pagoda-engine-reader", daemon=True)
        self._reader.start()

    def _start_process(self) -> None:
        self._inbox, self._outbox = self._ctx.Queue(), self._ctx.Queue()
        self._proc = self._ctx.Process(target=_process_main, args=(self._config, self._inbox, self._outbox, os.getpid()),
                                       name="pagoda-engine", daemon=True)
        self._proc.start()
        message: FromCore = self._outbox.get()
        if not isinstance(message, EngineReady):
            self._proc.join(timeout=5)
            raise RuntimeError(f"the engine process failed to start: {message.error}")
        self.limits: RequestLimits = message.limits
        self._stats: SchedulerStats = message.stats

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and not self.restarting and self._proc.is_alive()

    def stats(self) -> SchedulerStats:
        return self._stats

    def shutdown(self) -> None:
        self._closing = True
        self._inbox.put(Shutdown())
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)

    def _read(self) -> None:
        while not self._closing:
            error = self._read_until_exit()
            if error is None or self._closing:
                return
            self._fail(error)
            if not self._restart():
                return

    def _read_until_exit(self) -> BaseException | None:
        """Relay the engine's outputs until it stops (None) or dies (the error)."""
        reader = self._outbox._reader  # noqa: SLF001 - the queue's pipe, to wait on it with the sentinel
        while True:
            if wait([reader, self._proc.sentinel], timeout=1.0):
                try:
                    message: FromCore = self._outbox.get(timeout=0.05)
                except queue.Empty:
                    if self._proc.is_alive():
                        continue
                    self._proc.join(timeout=1)
                    return RuntimeError(f"the engine process exited (code {self._proc.exitcode})")
                match message:
                    case StepOutputs(outputs, stats):
                        self._stats = stats
                        if outputs:
                            self._on_outputs(outputs)
                    case DebugAnswer(query_id, snapshot, error):
                        self._on_answer(query_id, snapshot, error)
                    case EngineFailed(error):
                        return RuntimeError(error)
                    case EngineStopped():
                        return None

    def _restart(self) -> bool:
        """Start a new engine process if the restart budget allows; True once it is serving."""
        if self.num_restarts >= self.max_restarts:
            logger.error("engine process will not be restarted (%d of %d restarts used)", self.num_restarts, self.max_restarts)
            return False
        self.num_restarts += 1
        self.restarting = True
        logger.warning("restarting the engine process (restart %d of %d)", self.num_restarts, self.max_restarts)
        try:
            self._start_process()
        except BaseException as e:  # noqa: BLE001
            logger.error("engine restart failed: %s", e)
            self.dead_error = e
            return False
        finally:
            self.restarting = False
        self.dead_error = None
        logger.warning("engine process restarted; serving again")
        return True

    def _fail(self, error: BaseException) -> None:
        logger.error("engine process failed: %s", error)
        self.dead_error = error
        self._on_failure(error)
