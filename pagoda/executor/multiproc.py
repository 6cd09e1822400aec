"""Tensor parallelism over processes: rank 0 in the engine's process, one process per other rank.

Each step rank 0 broadcasts the call (method name and arguments: the ``SchedulerOutput``) to the
other ranks over the group's control channel, then every rank runs it; the forward passes meet
in the all-reduces. A rank that dies or hangs fails the engine (``WorkerFailedError``): a dead
peer closes its sockets, so rank 0's next collective raises, and a hung one exceeds the
collective timeout. A monitor thread watches the worker processes, so the engine knows at once
even while it idles. Workers die with the engine: they ignore SIGINT / SIGTERM (rank 0 decides),
ask the kernel for SIGKILL when their parent dies, and exit when rank 0's sockets close.

Multi-node (torchrun style): ``--nnodes N --node-rank K --master-addr A --master-port P``; node 0
runs the engine and its share of the ranks, every other node runs ``run_headless`` (its ranks
only, no scheduler). Ranks ``K * per_node ... (K + 1) * per_node - 1`` live on node K.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing as mp
from multiprocessing.connection import wait
import os
import signal
import socket
import sys
import threading
import weakref
from multiprocessing import resource_tracker
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.distributed.parallel_state import serve_rendezvous
from pagoda.executor.base import WorkerFailedError, Executor
from pagoda.executor.start_method import check_spawn_is_safe, start_method
from pagoda.heap import keep_freed_memory
from pagoda.worker.worker import Worker, cpu_share

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_ranks(config: EngineConfig) -> list[int]:
    pc = config.parallel
    per_node = pc.world_size // pc.nnodes
    return list(range(pc.node_rank * per_node, (pc.node_rank + 1) * per_node))


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        pc = config.parallel
        if pc.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes run their ranks with run_headless")
        self.master_addr = pc.master_addr
        store = serve_rendezvous(self.master_addr, pc.master_port, pc.world_size, pc.timeout_seconds)
        self.master_port = store.port
        self.dead: WorkerFailedError | None = None
        self._closing = False
        ranks = local_ranks(config)
        self.procs, self._errors = start_worker_processes(config, ranks[1:], self.master_addr, self.master_port)
        self._monitor = threading.Thread(target=self._watch, name="pagoda-tp-monitor", daemon=True)
        self._monitor.start()
        _use_cores(config, 0, len(ranks), pin=False)
        try:
            self.driver_worker = Worker(config, 0, self.master_addr, self.master_port, store,
                                        gone=lambda: None if self.dead is None else str(self.dead))
        except BaseException as e:
            died_first = self.dead  # a worker's death caused this; else ours caused theirs
            self._kill_workers()
            raise died_first or e from None
        # Garbage-collected or at exit without shutdown(): the workers still go.
        weakref.finalize(self, _kill_processes, self.procs)
        _live.add(self)

    # -- calls ------------------------------------------------------------------------------
    def run_on_all(self, method: str, args: tuple, gather: bool) -> Any:
        self.check_health()
        try:
            return call_every_rank(self.driver_worker, method, args, gather)
        except WorkerFailedError:
            raise
        except RuntimeError as e:  # gloo: a peer closed its connection, or a collective timed out
            self.dead = self.dead or WorkerFailedError(f"tensor-parallel worker failed during {method}: {e}")
            self._kill_workers()
            raise self.dead from e

    def check_health(self) -> None:
        if self.dead is not None:
            raise self.dead

    def _watch(self) -> None:
        """Notice a worker process that exits while the engine runs."""
        pending = {p.sentinel: p for p in self.procs}
        while pending and not self._closing:
            for sentinel in wait(list(pending), timeout=1.0):
                proc = pending.pop(sentinel)
                if not self._closing:
                    reason = "" if self._errors.empty() else f": {self._errors.get()}"
                    self.dead = self.dead or WorkerFailedError(
                        f"tensor-parallel worker {proc.name} exited (code {proc.exitcode}){reason}")
                    logger.error("%s", self.dead)
                    shm = getattr(getattr(self, "driver_worker", None), "tp", None)
                    if shm is not None and shm.shm is not None:
                        shm.shm.failed = str(self.dead)  # a rank spinning in a collective gives up

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        orderly = self.dead is None
        if orderly:
            with contextlib.suppress(Exception):
                self.driver_worker.tp.broadcast_object(("shutdown", (True,), False))
        self.driver_worker.shutdown(wait_for_ranks=orderly)
        for proc in self.procs:
            proc.join(timeout=5)
        self._kill_workers()

    def _kill_workers(self) -> None:
        _kill_processes(self.procs)


_live: weakref.WeakSet[MultiprocExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_live_executors() -> None:
    """At exit, before multiprocessing terminates its daemonic children: an orderly stop, so the
    monitor does not report the workers' deaths as failures."""
    for executor in list(_live):
        with contextlib.suppress(Exception):
            executor.shutdown()


def _kill_processes(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def call_every_rank(driver: Worker, method: str, args: tuple, gather: bool) -> Any:
    """Rank 0's half of the protocol the other ranks serve (``_serve_rank``): broadcast the call,
    run it here, and gather every rank's result if asked."""
    driver.tp.broadcast_object((method, args, gather))
    result = getattr(driver, method)(*args)
    return driver.tp.all_gather_object(result) if gather else result


def start_worker_processes(config: EngineConfig, ranks: list[int], master_addr: str, master_port: int):
    """The processes of ``ranks``, and the queue where a failing one leaves its reason. Forked
    where that is safe, else spawned (pagoda/executor/start_method.py)."""
    method, why = start_method()
    if method == "spawn":
        check_spawn_is_safe(why)
    else:  # a forked rank would start a resource tracker of its own, which reports rank 0's unlinked segment
        resource_tracker.ensure_running()
    ctx = mp.get_context(method)
    errors = ctx.SimpleQueue()
    procs = []
    with _children_allowed():
        for rank in ranks:
            proc = ctx.Process(target=_worker_main, args=(config, rank, master_addr, master_port, errors, method),
                               name=f"pagoda-tp-rank{rank}", daemon=True)
            proc.start()
            procs.append(proc)
    return procs, errors


@contextlib.contextmanager
def _children_allowed():
    """multiprocessing refuses children to a daemonic process, and the server's engine process
    (--engine-process) is one; its workers are cleaned up by the rules above instead."""
    config = mp.current_process()._config  # noqa: SLF001
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def _worker_main(config: EngineConfig, rank: int, master_addr: str, master_port: int, errors, method: str) -> None:
    """A non-driver rank: build the shard, then run rank 0's calls until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    # force: a forked rank has its parent's handlers, which would keep the rank out of its lines
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank{rank} %(name)s: %(message)s", force=True)
    if method == "fork":
        # OpenMP's thread pool belongs to the thread that used it, and a fork copies no threads: on
        # the forking thread, the first parallel region would wait forever for the parent's pool
        # (if the parent had run one). A new thread starts a pool of its own.
        failed: list[BaseException] = []
        runner = threading.Thread(target=_run_rank, args=(config, rank, master_addr, master_port, errors, failed),
                                  name=f"pagoda-tp-rank{rank}")
        runner.start()
        runner.join()
        if failed:
            sys.exit(1)
        return
    _run_rank(config, rank, master_addr, master_port, errors)


def _run_rank(config: EngineConfig, rank: int, master_addr: str, master_port: int, errors,
              failed: list[BaseException] | None = None) -> None:
    _use_cores(config, rank, len(local_ranks(config)), pin=True)
    try:
        _serve_rank(Worker(config, rank, master_addr, master_port))
    except BaseException as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        if failed is None:
            raise
        failed.append(e)
        logger.exception("rank %d failed", rank)


def _serve_rank(worker: Worker) -> None:
    while True:
        method, args, gather = worker.tp.broadcast_object()
        result = getattr(worker, method)(*args)
        if gather:
            worker.tp.all_gather_object(result)
        if method == "shutdown":
            return


def run_headless(config: EngineConfig) -> int:
    """A node other than 0: run this node's ranks until the engine stops (or one fails)."""
    pc = config.parallel
    if pc.master_port is None:
        raise ValueError("a multi-node engine needs --master-port (or MASTER_PORT) on every node")
    procs, _ = start_worker_processes(config, local_ranks(config), pc.master_addr, pc.master_port)
    logger.info("node %d of %d: ranks %s started", pc.node_rank, pc.nnodes, local_ranks(config))
    codes = []
    for proc in procs:
        proc.join()
        codes.append(proc.exitcode)
    return 0 if all(code == 0 for code in codes) else 1


def _use_cores(config: EngineConfig, rank: int, local_world_size: int, pin: bool) -> None:
    """Give a rank its share of this machine's cores (threads; pinned in worker processes)."""
    if config.model.device.type != "cpu":
        return
    cores = cpu_share(rank, local_world_size)
    if pin:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    keep_freed_memory()  # a worker process's heap too (pagoda/heap.py)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel sends SIGKILL when the parent exits (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
