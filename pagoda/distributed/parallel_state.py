"""The tensor-parallel group of a model: its rank, its size and its collectives.

A model captures its group when it is built (``building_with``), instead of reading a process-
wide default: a process may hold a TP=1 engine beside a TP=2 one (tests do), and
``torch.distributed``'s default group can exist once per process. So the group is a plain c10d
backend object (gloo on CPU, NCCL on CUDA) over a ``TCPStore`` rendezvous, used directly.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.distributed.shm_comm import ShmComm, shm_supported
from pagoda.scoped import Scoped

logger = logging.getLogger(__name__)


@dataclass
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    backend: Any = None  # c10d ProcessGroupGloo / ProcessGroupNCCL; None at world_size 1
    store: Any = None
    # gloo, without a timeout that matters: carries rank 0's orders (broadcast_object), which the
    # other ranks wait for as long as the engine idles. The collectives of a step run on
    # ``backend``, whose timeout (--distributed-timeout-seconds) turns a hung rank into an error.
    control: Any = None
    # Ranks on one machine: collectives and orders through shared memory (shm_comm.py), far
    # cheaper per call than gloo's sockets; None across machines (or where unsupported).
    shm: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # -- collectives (identity at world size 1) ---------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.world_size > 1:
            if self.shm is not None and x.device.type == "cpu" and self.shm.fits(x):
                return self.shm.all_reduce(x)
            self.backend.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` (equal shapes on every rank)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and x.device.type == "cpu" and self.shm.fits(x):
            return self.shm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.backend.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled: a length, then the bytes)."""
        if self.world_size == 1:
            return obj
        if self.shm is not None:
            if self.rank == 0:
                self.shm.send(obj)
                return obj
            return self.shm.receive()
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self.control.broadcast(payload, 0).wait()
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (on the control channel)."""
        if self.world_size == 1:
            return [obj]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self.control.allgather([sizes], [torch.tensor([payload.numel()], dtype=torch.int64)]).wait()
        width = int(max(sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        self.control.allgather([parts], [padded]).wait()
        return [pickle.loads(part[: int(size)].numpy().tobytes()) for part, size in zip(parts, sizes)]

    def close(self, wait_for_ranks: bool) -> None:
        """Leave the group. ``wait_for_ranks``: first meet every rank on the control channel (for
        up to 10 s), so that no rank tears its connections down while another still uses them.
        The c10d objects are released here rather than at interpreter exit, where destroying
        them with a peer's threads still live could abort the process."""
        if self.world_size == 1:
            return
        if wait_for_ranks:
            with contextlib.suppress(RuntimeError):
                self.control.allreduce([torch.zeros(1)]).wait(datetime.timedelta(seconds=10))
        if self.shm is not None:
            self.shm.close()
        self.backend = self.control = self.store = self.shm = None

    def wait_for_all(self) -> None:
        """Return once every rank got here (on the control channel: no timeout)."""
        if self.world_size > 1:
            self.control.allreduce([torch.zeros(1)]).wait()


SINGLE = TensorParallelGroup()


def serve_rendezvous(master_addr: str, master_port: int | None, world_size: int, timeout_seconds: float):
    """Rank 0's rendezvous store, listening before any other rank starts: on ``master_port``, or
    on a port the kernel picks (``store.port``), so no other process can take it in between."""
    import torch.distributed as dist  # torch.distributed loads on first use

    return dist.TCPStore(master_addr, master_port or 0, world_size, True,
                         timeout=_start_up_timeout(timeout_seconds), wait_for_workers=False)


def init_tensor_parallel(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
                         timeout_seconds: float, shared_memory_bytes: int = 0, store=None,
                         gone: Callable[[], str | None] = lambda: None) -> TensorParallelGroup:
    """Join the group: rank 0 serves the rendezvous store at master_addr:master_port (``store``:
    one it already serves, see ``serve_rendezvous``). ``shared_memory_bytes`` > 0 (every rank on
    this machine, CPU): the largest tensor the shared-memory collectives carry; larger ones go
    through gloo. ``gone``: why the start must stop (a rank died), or None."""
    import torch.distributed as dist  # torch.distributed loads on first use

    if world_size == 1:
        return SINGLE
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if store is None:
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=_start_up_timeout(timeout_seconds),
                              wait_for_workers=True)
    # Creating a group waits for every rank under the group's own timeout: meet them first, with
    # the start-up timeout and an eye on ranks that die meanwhile.
    _await_ranks(store, world_size, _start_up_timeout(timeout_seconds).total_seconds(), gone)
    control = dist.ProcessGroupGloo(dist.PrefixStore("pagoda-control", store), rank, world_size, _FOREVER)
    prefixed = dist.PrefixStore("pagoda-tp", store)
    if device.type == "cuda":
        backend = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        backend = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    shm = _join_shared_memory(store, rank, world_size, shared_memory_bytes, timeout_seconds) \
        if shared_memory_bytes > 0 and device.type == "cpu" and shm_supported() else None
    logger.info("tensor-parallel rank %d of %d joined (%s%s)", rank, world_size, type(backend).__name__,
                ", shared memory" if shm is not None else "")
    return TensorParallelGroup(rank, world_size, backend, store, control, shm)


def _join_shared_memory(store, rank: int, world_size: int, max_bytes: int, timeout_seconds: float) -> ShmComm:
    """Rank 0 creates the segment and publishes its name in the store; the others open it."""
    if rank == 0:
        name = f"pagoda-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        comm = ShmComm(name, 0, world_size, max_bytes, timeout_seconds)
        store.set("pagoda-shm", name)
        return comm
    return ShmComm(store.get("pagoda-shm").decode(), rank, world_size, max_bytes, timeout_seconds)


_FOREVER = datetime.timedelta(days=365)
# Ranks start at their own pace (spawn, import torch, build or load the kernels): the rendezvous
# waits this long whatever --distributed-timeout-seconds says of the collectives (a 3 s collective
# timeout once failed a start on a loaded machine).
START_UP_SECONDS = 600.0


def _await_ranks(store, world_size: int, timeout_seconds: float, gone: Callable[[], str | None]) -> None:
    """Until every rank has checked in at the store (a Python loop, so a dead rank can stop it)."""
    arrived, deadline = store.add("pagoda-arrived", 1), time.monotonic() + timeout_seconds
    while arrived < world_size:
        reason = gone()
        if reason is not None:
            raise RuntimeError(f"tensor-parallel start-up stopped: {reason}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel start-up: {arrived} of {world_size} ranks arrived in {timeout_seconds:g}s")
        time.sleep(0.05)
        arrived = store.add("pagoda-arrived", 0)


def _start_up_timeout(timeout_seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout_seconds, START_UP_SECONDS))


_building: Scoped[TensorParallelGroup] = Scoped("pagoda_tp_group", SINGLE)


def building_with(group: TensorParallelGroup) -> contextlib.AbstractContextManager:
    """Layers built inside the block take ``group`` as their tensor-parallel group."""
    return _building.using(group)


def current_group() -> TensorParallelGroup:
    """The group of the model being built (``SINGLE`` outside ``building_with``)."""
    return _building.get()
