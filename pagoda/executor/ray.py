"""Tensor parallelism over a Ray cluster: rank 0 in the engine's process, one Ray actor per other rank.

The engine joins a running cluster (``ray start --head``; ``RAY_ADDRESS`` names it, else Ray
looks for one on this machine) and never starts one of its own. A placement group reserves one
bundle per actor (a GPU each on CUDA, else an equal share of the engine node's CPUs), packed onto
as few nodes as will hold them. The ranks meet at a ``TCPStore`` served by rank 0 on this node,
as with the mp backend; each call reaches the actors as a Ray task (method name and arguments)
while rank 0 runs it here, and they meet in the step's collectives. A rank that dies or hangs
fails the engine (``EngineDeadError``): its task's ``RayActorError``, a collective that times
out, or gloo's error when a peer closes its sockets.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.executor.base import EngineDeadError, Executor
from pagoda.executor.multiproc import free_port
from pagoda.worker.worker import Worker

try:
    import ray
    from ray.exceptions import RayError
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # an optional extra
    raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'pagoda[ray]'") from e

logger = logging.getLogger(__name__)

NO_CLUSTER = "--distributed-executor-backend ray needs a running Ray cluster (ray start --head), or use mp"
PLACEMENT_TIMEOUT_SECONDS = 60.0
SHUTDOWN_TIMEOUT_SECONDS = 5.0
DEFAULT_MASTER_ADDR = "127.0.0.1"  # ParallelConfig's: not reachable from another node


class RankActor:
    """A non-driver rank inside a Ray actor. Creating it only stores the arguments: ``start``
    builds the Worker, which blocks until every rank has joined, so the engine can start all
    actors first and then build rank 0 (which serves the rendezvous)."""

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

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.parallel.nnodes != 1:
            raise ValueError("--nnodes / --node-rank are for the mp backend: Ray places the ranks over its cluster")
        self._owns_connection = connect(ray_address())
        self.dead: EngineDeadError | None = None
        self._closed = False
        self.placement_group: PlacementGroup | None = None
        self.actors: list[Any] = []
        try:
            self._start()
        except BaseException:
            self._release()
            raise

    def _start(self) -> None:
        """Reserve the bundles, start the actors, then build rank 0 (the rendezvous server)."""
        config, pc = self.config, self.config.parallel
        cores = cores_per_rank(pc.world_size)
        on_gpu = config.model.device.type == "cuda"
        self.placement_group = reserve(pc.world_size - 1, {"GPU": 1} if on_gpu else {"CPU": cores})
        master_addr = pc.master_addr if pc.master_addr != DEFAULT_MASTER_ADDR else ray.util.get_node_ip_address()
        master_port = pc.master_port or free_port(master_addr)
        self.actors = create_actors(config, self.placement_group, master_addr, master_port, cores, on_gpu)
        starts = [actor.start.remote() for actor in self.actors]
        if not on_gpu:
            torch.set_num_threads(cores)  # rank 0's share, as the mp backend gives it
        self.driver_worker = self._start_driver(starts, master_addr, master_port)
        ray.get(starts, timeout=pc.timeout_seconds)  # every rank joined: they are about done

    def _start_driver(self, starts: list[Any], master_addr: str, master_port: int) -> Worker:
        """Rank 0's Worker; if it fails (it waits for ranks that never join), an actor's own
        error says why better than the rendezvous timeout does."""
        try:
            return Worker(self.config, 0, master_addr, master_port)
        except BaseException as e:
            raise first_failure(starts) or e from None

    # -- calls ------------------------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any) -> Any:
        self.check_health()
        refs = [actor.call.remote(method, *args) for actor in self.actors]
        try:
            result = getattr(self.driver_worker, method)(*args)
            ray.get(refs, timeout=self.config.parallel.timeout_seconds)
        except (RayError, RuntimeError) as e:  # an actor died, timed out or failed; gloo: a peer left
            self.dead = self.dead or EngineDeadError(f"tensor-parallel rank failed during {method}: {e}")
            self._kill_actors()
            raise self.dead from e
        return result

    def check_health(self) -> None:
        if self.dead is not None:
            raise self.dead

    # -- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.dead is None:
            try:
                ray.get([actor.call.remote("shutdown") for actor in self.actors], timeout=SHUTDOWN_TIMEOUT_SECONDS)
            except RayError as e:
                logger.warning("tensor-parallel ranks did not shut down cleanly: %s", e)
        self._release()
        self.driver_worker.shutdown()

    def _kill_actors(self) -> None:
        for actor in self.actors:
            ray.kill(actor)

    def _release(self) -> None:
        """Free what this executor holds in the cluster, and leave this process's Ray
        connection as it was found."""
        self._kill_actors()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        if self._owns_connection:
            ray.shutdown()


def ray_address() -> str:
    """The cluster's address: ``RAY_ADDRESS``, else "auto" (a cluster started on this machine)."""
    return os.environ.get("RAY_ADDRESS", "auto")


def connect(address: str) -> bool:
    """Join the cluster at ``address``; True when this call connected the process (and so the
    executor disconnects it at shutdown), False when it already was connected."""
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
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ValueError(
            f"the Ray cluster could not place {num_bundles} x {bundle} for the tensor-parallel ranks in "
            f"{PLACEMENT_TIMEOUT_SECONDS:.0f}s (available: {ray.available_resources()})"
        ) from None
    return group


def create_actors(config: EngineConfig, group: PlacementGroup, master_addr: str, master_port: int,
                  cores: int, on_gpu: bool) -> list[Any]:
    """One actor per non-driver rank, rank r in bundle r - 1 of ``group``."""
    actor_class = ray.remote(RankActor)
    actors = []
    for rank in range(1, config.parallel.world_size):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank - 1)
        options = {"num_cpus": 0, "num_gpus": 1} if on_gpu else {"num_cpus": cores}
        actors.append(actor_class.options(scheduling_strategy=strategy, **options).remote(
            config, rank, master_addr, master_port, None if on_gpu else cores))
    return actors


def first_failure(refs: list[Any]) -> RayError | None:
    """The error of the first of ``refs`` that has already failed, if one has."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in done:
        try:
            ray.get(ref)
        except RayError as e:
            return e
    return None
