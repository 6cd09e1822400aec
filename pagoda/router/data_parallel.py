"""`pagoda serve --data-parallel-size N`: N engine replicas on this host behind the router, in
one command.

- Each replica is `pagoda serve` with the command's own arguments, in a process of its own, on
  a free 127.0.0.1 port, with its share of the cores: `worker.cpu_share(rank, N)` of this
  process's affinity set, the split the tensor-parallel executor gives its ranks, one level up
  (a replica with `--tensor-parallel-size T` splits its share again among its ranks). The
  replica pins itself to it and sizes torch's (and OpenMP's) thread pool to it before the
  model loads (`pagoda serve ARGS... --data-parallel-rank RANK`, `pin_replica`).
- The router (pagoda.router.app, in this process) listens on `--host`/`--port`, with
  `--router-policy` and the `--router-*` gateway limits, and starts once every replica answers
  `/health`, all at full weight.
- A replica that exits on its own (crashed, killed) is started again on its port, at most
  `--max-replica-restarts` times; the router's probes take it out while it is gone and warm it
  up (`--router-warmup-seconds`) when it answers again.
- SIGINT / SIGTERM: the router stops taking connections and lets its requests finish
  (`--shutdown-timeout`), then ends the streams still open with a `shutting_down` error event
  and `data: [DONE]` (as `pagoda serve` does); then every replica gets SIGTERM and drains the
  same way; a replica still there after that is killed. The replicas run in sessions of their own, so a Ctrl-C at
  the terminal reaches only this process, which stops them in that order; and each gets
  SIGTERM from the kernel if this process dies without stopping them (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import uvicorn

from pagoda import __version__, envs
from pagoda.entrypoints.graceful import bind_listener
from pagoda.router.app import Router
from pagoda.router.config import RouterConfig
from pagoda.router.options import admin_key
from pagoda.router.server import RouterServer, build_app

logger = logging.getLogger("pagoda.router")

REPLICA_HOST = "127.0.0.1"
STARTUP_TIMEOUT = 900.0  # seconds for a replica's first /health (a first run builds the CPU kernels)
SUPERVISE_INTERVAL = 0.5  # seconds between checks that the replicas are still running
STOP_GRACE = 15.0  # seconds a replica gets beyond --shutdown-timeout before it is killed
PARENT_ENV = "PAGODA_DP_PARENT"


def free_port(host: str = REPLICA_HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    rank: int
    port: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    given_up: bool = False

    @property
    def url(self) -> str:
        return f"http://{REPLICA_HOST}:{self.port}"


class ReplicaSet:
    """The replica processes: started, watched (restarted when one exits), stopped."""

    def __init__(self, serve_argv: list[str], size: int, *, max_restarts: int = 3,
                 shutdown_timeout: float = 10.0) -> None:
        self.serve_argv, self.size = serve_argv, size
        self.max_restarts, self.shutdown_timeout = max_restarts, shutdown_timeout
        self.replicas = [Replica(rank, free_port()) for rank in range(size)]
        self.stopping = False
        self.hurry = False  # a second stop signal: the replicas get theirs twice (abort, not drain)

    def command(self, replica: Replica) -> list[str]:
        # The command's own arguments, then what makes it one replica: argparse keeps the last
        # value of an option, so these win over the user's --port, --host, --data-parallel-size.
        return [sys.executable, "-m", "pagoda.cli", *self.serve_argv, "--data-parallel-rank",
                str(replica.rank), "--host", REPLICA_HOST, "--port", str(replica.port)]

    def spawn(self, replica: Replica) -> None:
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        replica.proc = subprocess.Popen(self.command(replica), env=env, start_new_session=True)
        logger.info("replica %d: pid %d on %s", replica.rank, replica.proc.pid, replica.url)

    def start(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Start every replica and return once all answer /health 200 (RuntimeError, with all of
        them stopped, if one exits or the time runs out first)."""
        for replica in self.replicas:
            self.spawn(replica)
        deadline = time.monotonic() + timeout
        pending = list(self.replicas)
        try:
            with httpx.Client(timeout=2.0) as client:
                while pending:
                    for replica in list(pending):
                        assert replica.proc is not None
                        if replica.proc.poll() is not None:
                            raise RuntimeError(f"replica {replica.rank} exited with {replica.proc.returncode} "
                                               "while starting (its log is above)")
                        with contextlib.suppress(httpx.HTTPError):
                            if client.get(f"{replica.url}/health").status_code == 200:
                                pending.remove(replica)
                    if pending and time.monotonic() > deadline:
                        raise RuntimeError(f"replica(s) {[r.rank for r in pending]} did not answer /health "
                                           f"within {timeout:.0f} s")
                    if pending:
                        time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def check(self) -> list[Replica]:
        """Restart the replicas that exited on their own (each at most `max_restarts` times);
        returns those restarted now."""
        restarted = []
        for replica in self.replicas:
            proc = replica.proc
            if self.stopping or replica.given_up or proc is None or proc.poll() is None:
                continue
            if replica.restarts >= self.max_restarts:
                replica.given_up = True
                logger.error("replica %d exited with %s and has been restarted %d times: not again", replica.rank,
                             proc.returncode, replica.restarts)
                continue
            replica.restarts += 1
            logger.warning("replica %d exited with %s: restarting it on %s (%d of %d)", replica.rank,
                           proc.returncode, replica.url, replica.restarts, self.max_restarts)
            self.spawn(replica)
            restarted.append(replica)
        return restarted

    async def supervise(self, interval: float = SUPERVISE_INTERVAL) -> None:
        while not self.stopping:
            self.check()
            await asyncio.sleep(interval)

    def stop(self) -> None:
        """SIGTERM to every replica (each drains for --shutdown-timeout), then wait; kill what is
        still there after that."""
        self.stopping = True
        procs = [r.proc for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
                if self.hurry:
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout + STOP_GRACE
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("replica pid %d did not stop in time: killing it", proc.pid)
                proc.kill()
                proc.wait()


def run_data_parallel(ns: argparse.Namespace) -> int:
    """`pagoda serve --data-parallel-size N`: until SIGINT / SIGTERM; returns the exit status."""
    size = ns.data_parallel_size
    if getattr(ns, "nnodes", 1) > 1:
        raise ValueError("--data-parallel-size starts replicas on this host; it does not combine with --nnodes "
                         "(point `pagoda router` at the replicas of other hosts instead)")
    key = admin_key(ns.router_admin_key, "--router-admin-key")
    sock = bind_listener(ns.host, ns.port)
    replicas = ReplicaSet(list(ns.argv), size, max_restarts=ns.max_replica_restarts,
                          shutdown_timeout=ns.shutdown_timeout)
    print(f"pagoda {__version__}: starting {size} replicas of {ns.model} on "
          f"{', '.join(r.url for r in replicas.replicas)}", flush=True)
    try:
        replicas.start()
        config = RouterConfig(
            workers=[r.url for r in replicas.replicas], policy=ns.router_policy, admin_key=key,
            max_requests_in_flight=ns.router_max_requests_in_flight, qps=ns.router_qps,
            qps_per_key=ns.router_qps_per_key, warmup_seconds=ns.router_warmup_seconds,
            health_interval=ns.router_health_interval)
        app = build_app(config)
        _supervise_while_serving(app, replicas)
        logging.getLogger("httpx").setLevel(logging.WARNING)
        print(f"pagoda: router ({config.policy}) for {size} replicas serving on http://{ns.host}:{ns.port}/v1",
              flush=True)
        server = _ReplicasFront(uvicorn.Config(app, log_level=ns.log_level, access_log=False), app.state.router,
                                ns.shutdown_timeout, replicas)
        server.run(sockets=[sock])
    finally:
        replicas.stop()
        sock.close()
    print("pagoda: stopped", flush=True)
    return 0


def _supervise_while_serving(app, replicas: ReplicaSet) -> None:
    """Watch the replicas (restarting those that exit) for as long as the router's app runs."""
    router_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with router_lifespan(a):
            watcher = asyncio.create_task(replicas.supervise())
            try:
                yield
            finally:
                replicas.stopping = True
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher

    app.router.lifespan_context = lifespan


class _ReplicasFront(RouterServer):
    """The router's server with the replicas behind it. Its stop rules are the router's (and
    serve's): the first SIGINT / SIGTERM drains the router for --shutdown-timeout, then its open
    streams end with an error event and `data: [DONE]`; the replicas are stopped after it
    (ReplicaSet.stop). A second signal hurries: the replicas get a second SIGTERM too, which
    aborts their requests."""

    def __init__(self, config: uvicorn.Config, router: Router, shutdown_timeout: float, replicas: ReplicaSet) -> None:
        super().__init__(config, router, shutdown_timeout)
        self.replicas = replicas

    def on_hurry(self) -> None:
        self.replicas.hurry = True


# --- one replica ------------------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
    """SIGTERM from the kernel when the supervising process exits (Linux; a no-op elsewhere)."""
    if not parent:  # started by hand (or by a test): no supervisor to follow
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it exited before the line above
        sys.exit(0)


def pin_replica(rank: int, size: int) -> None:
    """Make this process (`pagoda serve --data-parallel-rank RANK`) replica RANK of SIZE: it
    follows its supervisor's exit, and it runs on its share of the cores (the tensor-parallel
    ranks' split), with torch's and OpenMP's threads to match, before any model loads."""
    if not 0 <= rank < size:
        raise ValueError(f"--data-parallel-rank must be in [0, {size}), got {rank}")
    parent = envs.PAGODA_DP_PARENT
    os.environ.pop(PARENT_ENV, None)  # not for this replica's own children
    _die_with_parent(int(parent or 0))
    from pagoda.worker.worker import cpu_share  # deferred: loads numpy, torch

    cores = cpu_share(rank, size)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))  # for an --engine-process child, too
    import torch  # torch loads on first use

    torch.set_num_threads(len(cores))
    logging.getLogger("pagoda.router").info("replica %d of %d: cores %s", rank, size, cores)
