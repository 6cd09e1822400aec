"""Tensor parallelism over a Ray cluster: rank 0 in the engine's process, one Ray actor per other rank.

The engine joins a running cluster (``ray start --head``; ``RAY_ADDRESS`` names it, else Ray
looks for one on this machine) and never starts one of its own. A placement group reserves one
bundle per actor (a GPU each on CUDA, else an equal share of the engine node's CPUs), packed onto
as few nodes as will hold them. Ray places and starts the ranks; once they have joined the group
(a ``TCPStore`` served by rank 0 on this node), calls take the mp backend's path: rank 0
broadcasts each one on the group's control channel to the actors' serve loops, then runs it. A
Ray task per call would cost about as much as a small model's step: measured on 2 cores, ~1.2-1.9
ms per round trip, against ~0.06 ms for the broadcast.

A rank that dies or hangs fails the engine (``WorkerFailedError``): gloo's error when a peer
closes its sockets, a collective that times out, or an actor's serve task that ends (the actor
died, or a call raised there), which ``check_health`` sees even while the engine idles. The
cluster gets its resources back on shutdown, on a failed start, and when the executor is
garbage-collected without one.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor, WorkerFailedError
from pagoda.executor.multiproc import _serve_rank, free_port  # the mp backend's loop: one protocol
from pagoda.worker.worker import Worker

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayError
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # an optional extra
    raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'pagoda[ray]'") from e

logger = logging.getLogger(__name__)

NO_CLUSTER = "--distributed-executor-backend ray needs a running Ray cluster (ray start --head), or use mp"
PLACEMENT_TIMEOUT_SECONDS = 60.0
SHUTDOWN_TIMEOUT_SECONDS = 5.0
DEFAULT_MASTER_ADDR = "127.0.0.1"  # ParallelConfig's default: not reachable from another node


@ray.remote
class RankActor:
    """A non-driver rank. Creating it only stores the arguments: ``start`` builds the Worker,
    which blocks until every rank has joined, so the engine starts all actors first and then
    builds rank 0 (which serves the rendezvous). ``serve`` then runs rank 0's calls until the
    last one, "shutdown"."""

    def __init__(self, config: EngineConfig, rank: int, master_addr: str, master_port: int,
                 num_threads: int | None) -> None:
        self.config, self.rank = config, rank
        self.master_addr, self.master_port = master_addr, master_port
        self.num_threads = num_threads
        self.worker: Worker | None = None

    def start(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)  # the bundle's cores, not the whole node's
        self.worker = Worker(self.config, self.rank, self.master_addr, self.master_port)

    def serve(self) -> None:
        _serve_rank(self.worker)


@dataclass
class ClusterLease:
    """What an executor holds in the cluster, given back once: on shutdown, on a failed start,
    or when the executor is garbage-collected (it holds no reference to the executor)."""

    owns_connection: bool  # this engine connected the process: it disconnects it too
    placement_group: PlacementGroup | None = None
    actors: list[Any] = field(default_factory=list)
    released: bool = False

    def kill_actors(self) -> None:
        for actor in self.actors:
            ray.kill(actor)

    def release(self) -> None:
        if self.released or not ray.is_initialized():  # at exit Ray may have shut down first
            return
        self.released = True
        self.kill_actors()
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
        self._serving: list[Any] = []  # each actor's serve task, from the end of the start on
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
        """Reserve the bundles, start the actors, then build rank 0."""
        config, pc = self.config, self.config.parallel
        cores = cores_per_rank(pc.world_size)
        on_gpu = config.model.device.type == "cuda"
        if pc.world_size > 1:  # at 1, rank 0 alone: nothing to place
            self.lease.placement_group = reserve(pc.world_size - 1, {"GPU": 1} if on_gpu else {"CPU": cores})
        master_addr = pc.master_addr if pc.master_addr != DEFAULT_MASTER_ADDR else ray.util.get_node_ip_address()
        master_port = pc.master_port or free_port(master_addr)
        self.actors.extend(create_actors(config, self.lease.placement_group, master_addr, master_port, cores, on_gpu))
        starts = [actor.start.remote() for actor in self.actors]
        if not on_gpu:
            torch.set_num_threads(cores)  # rank 0's share, as the mp backend gives it
        self.driver_worker = self._start_driver(starts, master_addr, master_port)
        ray.get(starts, timeout=pc.timeout_seconds)  # every rank has joined: they are about done
        self._serving = [actor.serve.remote() for actor in self.actors]

    def _start_driver(self, starts: list[Any], master_addr: str, master_port: int) -> Worker:
        """Rank 0's Worker. If it fails (it waits for ranks that never join), an actor's own
        error says why better than the rendezvous timeout does."""
        try:
            return Worker(self.config, 0, master_addr, master_port)
        except Exception as e:
            raise first_failure(starts) or e from None

    # -- calls ------------------------------------------------------------------------------
    def run_on_all(self, method: str, args: tuple, gather: bool) -> Any:
        self.check_health()
        try:
            tp = self.driver_worker.tp
            tp.broadcast_object((method, args, gather))
            result = getattr(self.driver_worker, method)(*args)
            return tp.all_gather_object(result) if gather else result
        except RuntimeError as e:  # gloo: a peer closed its connection, or a collective timed out
            raise self._fail(f"tensor-parallel rank failed during {method}: {e}") from e

    def check_health(self) -> None:
        """A serve task that ended means its rank is gone (while the engine runs, they never end)."""
        if self.dead is None and not self._closed:
            ended, _ = ray.wait(self._serving, num_returns=1, timeout=0)
            if ended:
                rank = self._serving.index(ended[0]) + 1
                self._fail(f"tensor-parallel rank {rank} stopped: {first_failure(ended) or 'its serve loop returned'}")
        if self.dead is not None:
            raise self.dead

    def _fail(self, reason: str) -> WorkerFailedError:
        self.dead = self.dead or WorkerFailedError(reason)
        logger.error("%s", self.dead)
        self.lease.kill_actors()
        return self.dead

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.dead is None:
            try:
                self.driver_worker.tp.broadcast_object(("shutdown", (), False))
                ray.get(self._serving, timeout=SHUTDOWN_TIMEOUT_SECONDS)
            except (RayError, RuntimeError) as e:
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


def create_actors(config: EngineConfig, group: PlacementGroup | None, master_addr: str, master_port: int,
                  cores: int, on_gpu: bool) -> list[Any]:
    """One actor per non-driver rank, rank r in bundle r - 1 of ``group``."""
    resources = {"num_cpus": 0, "num_gpus": 1} if on_gpu else {"num_cpus": cores}
    return [
        RankActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank - 1),
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
