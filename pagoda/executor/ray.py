"""Tensor parallelism over a Ray cluster: rank 0 in the engine's process, one Ray actor per other rank.

The engine joins a running cluster (``ray start --head``; ``RAY_ADDRESS`` names it, else Ray
looks for one on this machine) and never starts one of its own. A placement group reserves one
bundle per actor (a GPU each on CUDA, else an equal share of the engine node's CPUs), packed onto
as few nodes as will hold them. Ray places and starts the ranks; they join the group at a
``TCPStore`` served by rank 0 on this node, and from then on calls take the mp backend's path:
rank 0 broadcasts each one to the actors' serve loops, then runs it. (A Ray task per call would
cost about as much as a small model's step, many times the broadcast: benchmarks/code_notes.md.)

Each actor runs one long task: build its Worker, then serve until rank 0 says "shutdown". A
watcher thread waits on those tasks: one that ends before then (the actor died, or raised while
starting or serving) fails the engine (``WorkerFailedError``) at once, even mid-collective or
while the engine idles; a hung rank fails it at the collective timeout. The cluster gets its
resources back on shutdown, on a failed start, and when the executor is garbage-collected.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor, WorkerFailedError
from pagoda.executor.multiproc import _serve_rank, call_every_rank, free_port  # the mp backend's protocol
from pagoda.worker.worker import Worker

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayError
    from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # an optional extra
    raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'pagoda[ray]'") from e

logger = logging.getLogger(__name__)

NO_CLUSTER = "--distributed-executor-backend ray needs a running Ray cluster (ray start --head), or use mp"
PLACEMENT_TIMEOUT_SECONDS = 60.0
SHUTDOWN_TIMEOUT_SECONDS = 5.0
WATCH_INTERVAL_SECONDS = 1.0
DEFAULT_MASTER_ADDR = "127.0.0.1"  # ParallelConfig's default: not reachable from another node


@ray.remote
class RankActor:
    """A non-driver rank. Creating it only stores the arguments, so the engine can create every
    actor, start their ``run`` and only then build rank 0 (which serves the rendezvous)."""

    def __init__(self, config: EngineConfig, rank: int, master_addr: str, master_port: int,
                 num_threads: int | None) -> None:
        self.config, self.rank = config, rank
        self.master_addr, self.master_port = master_addr, master_port
        self.num_threads = num_threads

    def run(self) -> None:
        """Build the Worker (it joins the group and loads its shard), then run rank 0's calls
        until "shutdown"."""
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)  # the bundle's cores, not the whole node's
        _serve_rank(Worker(self.config, self.rank, self.master_addr, self.master_port))


@dataclass
class ClusterLease:
    """What an executor holds in the cluster, and the watch on its actors. It keeps no reference
    to the executor, so a garbage-collected executor's finalizer can release it. At exit it is
    released before Ray disconnects (atexit runs the later registration first): a Ray call after
    that would connect again."""

    owns_connection: bool  # this engine connected the process: it disconnects it too
    placement_group: PlacementGroup | None = None
    actors: list[Any] = field(default_factory=list)
    failure: str | None = None  # why a rank is gone, set by the watcher
    shm: Any = None  # rank 0's shared-memory channel, once built: told to stop waiting on a failure
    _stopping: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None
    _released: bool = False

    def __post_init__(self) -> None:
        atexit.register(self.release)

    def watch(self, runs: list[Any]) -> None:
        """Until ``stop_watching``, the first of the actors' ``run`` tasks to end fails the lease."""
        self._watcher = threading.Thread(target=self._watch, args=(runs,), name="pagoda-ray-watch", daemon=True)
        self._watcher.start()

    def _watch(self, runs: list[Any]) -> None:
        while not self._stopping.is_set() and ray.is_initialized():
            ended, _ = ray.wait(runs, num_returns=1, timeout=WATCH_INTERVAL_SECONDS)
            if ended and not self._stopping.is_set():
                rank = runs.index(ended[0]) + 1
                self.failure = f"tensor-parallel rank {rank} stopped: {first_failure(ended) or 'it returned'}"
                logger.error("%s", self.failure)
                if self.shm is not None:
                    self.shm.failed = self.failure  # rank 0 waiting in a collective gives up
                self.kill_actors()  # closes their sockets: rank 0 waiting on gloo gives up
                return

    def stop_watching(self) -> None:
        self._stopping.set()

    def kill_actors(self) -> None:
        for actor in self.actors:
            ray.kill(actor)

    def release(self) -> None:
        if self._released or not ray.is_initialized():  # at exit Ray may have shut down first
            return
        self._released = True
        atexit.unregister(self.release)
        self.stop_watching()
        self.kill_actors()  # ends the tasks the watcher waits on
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        if self.owns_connection:
            ray.shutdown()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.parallel.nnodes != 1:
            raise ValueError("--nnodes / --node-rank are for the mp backend: Ray places the ranks over its cluster")
        self.dead: WorkerFailedError | None = None
        self._closed = False
        self.lease = ClusterLease(owns_connection=connect(ray_address()))
        weakref.finalize(self, self.lease.release)
        try:
            self._start()
        except BaseException:
            self.lease.release()
            raise

    @property
    def actors(self) -> list[Any]:
        return self.lease.actors

    def _start(self) -> None:
        """Place and start the other ranks, then build rank 0 (it waits until they have joined)."""
        pc = self.config.parallel
        cores = cores_per_rank(pc.world_size)
        on_gpu = self.config.model.device.type == "cuda"
        config, master_addr, master_port = self.config, pc.master_addr, pc.master_port
        if pc.world_size > 1:  # at 1, rank 0 alone: nothing to place or watch
            config, master_addr, master_port = self._start_actors(cores, on_gpu)
        if not on_gpu:
            torch.set_num_threads(cores)  # rank 0's share, as the mp backend gives it
        try:
            self.driver_worker = Worker(config, 0, master_addr, master_port)
        except Exception as e:  # an actor's own error says why better than a closed socket does
            raise WorkerFailedError(self.lease.failure) if self.lease.failure else e from None
        self.lease.shm = self.driver_worker.tp.shm

    def _start_actors(self, cores: int, on_gpu: bool) -> tuple[EngineConfig, str, int]:
        """Reserve a bundle for each other rank and start its actor; the config, address and port
        the ranks meet with."""
        pc = self.config.parallel
        group, first_bundle, cpus = enclosing_group(pc.world_size), 1, float(cores)
        if group is None:  # a group of our own, one bundle a rank past 0, given back on release
            group = self.lease.placement_group = reserve(pc.world_size - 1, {"GPU": 1} if on_gpu else {"CPU": cores})
            first_bundle = 0
        elif not on_gpu:  # the enclosing group's bundles say what a rank gets
            cpus = group.bundle_specs[1].get("CPU", 0.0)
            cores = max(1, int(cpus))
        config = as_placed(self.config, group)
        master_addr = pc.master_addr if pc.master_addr != DEFAULT_MASTER_ADDR else ray.util.get_node_ip_address()
        master_port = pc.master_port or free_port(master_addr)
        self.actors.extend(create_actors(config, group, master_addr, master_port, cores, on_gpu, first_bundle, cpus))
        self.lease.watch([actor.run.remote() for actor in self.actors])
        return config, master_addr, master_port

    # -- calls ------------------------------------------------------------------------------
    def run_on_all(self, method: str, args: tuple, gather: bool) -> Any:
        self.check_health()
        try:
            return call_every_rank(self.driver_worker, method, args, gather)
        except RuntimeError as e:  # a peer closed its sockets, a rank is gone, or a collective timed out
            reason = self.lease.failure or f"tensor-parallel rank failed during {method}: {e}"
            self.dead = self.dead or WorkerFailedError(reason)
            self.lease.kill_actors()
            raise self.dead from e

    def check_health(self) -> None:
        if self.dead is None and self.lease.failure is not None:
            self.dead = WorkerFailedError(self.lease.failure)
        if self.dead is not None:
            raise self.dead

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.lease.stop_watching()  # the run tasks end now, as they should
        if self.dead is None and self.lease.failure is None:
            try:
                self.driver_worker.tp.broadcast_object(("shutdown", (), False))
            except RuntimeError as e:
                logger.warning("tensor-parallel ranks did not shut down cleanly: %s", e)
        self.lease.release()
        self.driver_worker.shutdown()


def ray_address() -> str:
    """The cluster's address: ``RAY_ADDRESS``, else "auto" (a cluster started on this machine)."""
    return os.environ.get("RAY_ADDRESS", "auto")


def connect(address: str) -> bool:
    """Join the cluster at ``address``; True when this call connected the process, False when
    it already was connected."""
    if ray.is_initialized():
        return False
    if address != "auto" and not accepts_connections(address):
        raise ValueError(f"{NO_CLUSTER}: nothing listens at RAY_ADDRESS={address}")
    try:
        ray.init(address=address)
    except ConnectionError as e:
        raise ValueError(f"{NO_CLUSTER}: {e}") from e
    return True


def accepts_connections(address: str, timeout: float = 5.0) -> bool:
    """Whether ``[scheme://]host:port`` accepts a TCP connection. Asked first because ray.init
    retries an address where nothing listens for minutes before it gives up."""
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def cores_per_rank(world_size: int) -> int:
    """An equal share of the engine node's CPUs (as Ray counts them), at least one."""
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return max(1, int(node["Resources"].get("CPU", 0)) // world_size)


def reserve(num_bundles: int, bundle: dict[str, float]) -> PlacementGroup:
    """A placement group of ``num_bundles`` x ``bundle``, packed; a ValueError if the cluster
    cannot place it in time."""
    group = placement_group([bundle] * num_bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_SECONDS)
    except GetTimeoutError:
        remove_placement_group(group)
        raise ValueError(
            f"the Ray cluster could not place {num_bundles} x {bundle} for the tensor-parallel ranks in "
            f"{PLACEMENT_TIMEOUT_SECONDS:.0f}s (available: {ray.available_resources()})"
        ) from None
    return group


def as_placed(config: EngineConfig, group: PlacementGroup) -> EngineConfig:
    """The config the ranks run with: ``nnodes`` counts the machines the ranks landed on (this
    one and the bundles'), since workers on one machine talk through shared memory."""
    nodes = set(placement_group_table(group)["bundles_to_node_id"].values())
    nodes.add(ray.get_runtime_context().get_node_id())
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, nnodes=len(nodes)))


def enclosing_group(world_size: int) -> PlacementGroup | None:
    """The placement group this process runs in, if it has a bundle for every rank: a Ray Serve
    replica reserves one bundle per rank (pagoda/ray_serve/app.py), runs in bundle 0, and its
    ranks 1..N-1 go in the others (a group of our own would need resources the replica's
    already holds)."""
    group = ray.util.get_current_placement_group()
    return group if group is not None and len(group.bundle_specs) >= world_size else None


def create_actors(config: EngineConfig, group: PlacementGroup, master_addr: str, master_port: int,
                  cores: int, on_gpu: bool, first_bundle: int = 0, cpus: float | None = None) -> list[Any]:
    """One actor per non-driver rank, rank r in bundle r - 1 + ``first_bundle`` of ``group``,
    reserving ``cpus`` (default ``cores``) and running ``cores`` threads."""
    resources = {"num_cpus": 0, "num_gpus": 1} if on_gpu else {"num_cpus": cores if cpus is None else cpus}
    return [
        RankActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank - 1 + first_bundle),
            **resources,
        ).remote(config, rank, master_addr, master_port, None if on_gpu else cores)
        for rank in range(1, config.parallel.world_size)
    ]


def first_failure(refs: list[Any]) -> RayError | None:
    """The error of the first of ``refs`` that has already failed, if one has."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in done:
        try:
            ray.get(ref)
        except RayError as e:
            return e
    return None
