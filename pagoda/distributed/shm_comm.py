"""Collectives and rank 0's orders through shared memory, for ranks on one machine.

gloo's all-reduce costs about a millisecond a call on a small CPU (two socket round trips and
its own threads), and a decoder step makes two per layer: on a 2-core machine that was most of
a TP=2 decode step. Ranks on one machine instead meet in one shared-memory segment (vLLM's CPU
backend does the same):

- **Exchange** (all-reduce, all-gather): each rank writes its tensor into its slot, then
  publishes the call's sequence number; once every rank has published it, each reads all slots
  and sums (or concatenates) them in rank order, so every rank gets the same bits. Two sets of
  slots alternate between calls: a rank can only be one call ahead, and by the time it writes a
  slot again every other rank has finished reading it (they published the call after it).
- **Orders** (rank 0 → all): a ring of message slots with sequence numbers. The others poll it;
  while the engine idles they back off to sleeps of up to a millisecond.

Waiting spins with ``sched_yield``, so oversubscribed ranks (TP=3 on 2 cores) hand the core over
instead of burning it. x86 keeps stores in order, so a published sequence number implies the data
written before it is visible (the kind of machine this project runs on; others keep gloo).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import platform
import time
import weakref
from multiprocessing import shared_memory

import numpy as np
import torch

_LINE = 64  # bytes: one counter per cache line
_ORDER_SLOTS = 4


def shm_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmComm:
    def __init__(self, name: str, rank: int, world_size: int, max_bytes: int, timeout_seconds: float,
                 max_order_bytes: int = 1 << 22) -> None:
        self.rank, self.world_size = rank, world_size
        self.max_bytes, self.max_order_bytes = max_bytes, max_order_bytes
        self.timeout_seconds = timeout_seconds
        self.failed: str | None = None  # set (by the executor's monitor) when a rank is gone: waits stop
        header = _LINE * (2 * world_size + 1)
        order_slot = _LINE + max_order_bytes
        size = header + 2 * world_size * max_bytes + _ORDER_SLOTS * order_slot
        if rank == 0:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            np.ndarray((size,), np.uint8, self.shm.buf)[:header] = 0
            weakref.finalize(self, _unlink, self.shm)  # also without close(): at exit, or when collected
        else:
            # Rank 0 unlinks it. (Ranks, forked or spawned, share rank 0's resource tracker, where opening
            # registers the name again: it is one entry, removed by rank 0's unlink.)
            self.shm = shared_memory.SharedMemory(name=name)
        buf = self.shm.buf
        self._published = np.ndarray((world_size,), np.int64, buf, 0, (_LINE,))  # per rank: last call
        self._order_seq = np.ndarray((1,), np.int64, buf, _LINE * world_size)
        self._acked = np.ndarray((world_size,), np.int64, buf, _LINE * (world_size + 1), (_LINE,))  # orders read
        self._slots = np.ndarray((2, world_size, max_bytes), np.uint8, buf, header)
        base = header + 2 * world_size * max_bytes
        self._order_heads = [np.ndarray((2,), np.int64, buf, base + i * order_slot) for i in range(_ORDER_SLOTS)]
        self._order_data = [np.ndarray((max_order_bytes,), np.uint8, buf, base + i * order_slot + _LINE)
                            for i in range(_ORDER_SLOTS)]
        self._calls = 0
        self._orders_seen = 0

    # -- exchange ---------------------------------------------------------------------------
    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.max_bytes

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype on every rank), as views of the segment."""
        self._calls += 1
        parity = self._calls % 2
        nbytes = x.numel() * x.element_size()
        mine = torch.from_numpy(self._slots[parity, self.rank, :nbytes]).view(x.dtype).view(x.shape)
        mine.copy_(x)
        self._published[self.rank] = self._calls
        self._wait(lambda: bool((self._published >= self._calls).all()), idle=False)
        return [torch.from_numpy(self._slots[parity, r, :nbytes]).view(x.dtype).view(x.shape)
                for r in range(self.world_size)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        x.copy_(total)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(x.contiguous()), dim=dim)

    # -- rank 0's orders --------------------------------------------------------------------
    def send(self, obj) -> None:
        """Rank 0: publish the next order. Slots are reused every _ORDER_SLOTS orders; the step's
        all-reduces keep the ranks within one order of each other."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.max_order_bytes:
            raise ValueError(f"an order of {len(data)} bytes exceeds the shared ring's {self.max_order_bytes}")
        seq = int(self._order_seq[0]) + 1
        i = seq % _ORDER_SLOTS
        # the slot's previous order (seq - _ORDER_SLOTS) must have been read by every rank
        self._wait(lambda: bool((self._acked[1:] >= seq - _ORDER_SLOTS).all()), idle=False)
        self._order_data[i][: len(data)] = np.frombuffer(data, np.uint8)
        self._order_heads[i][1] = len(data)
        self._order_heads[i][0] = seq
        self._order_seq[0] = seq

    def receive(self):
        """Other ranks: the next order (waits for it)."""
        seq = self._orders_seen + 1
        i = seq % _ORDER_SLOTS
        self._wait(lambda: int(self._order_heads[i][0]) >= seq, idle=True)
        self._orders_seen = seq
        order = pickle.loads(self._order_data[i][: int(self._order_heads[i][1])].tobytes())
        self._acked[self.rank] = seq
        return order

    def close(self) -> None:
        self._published = self._order_seq = self._slots = None
        self._order_heads = self._order_data = []
        if self.rank == 0:
            _unlink(self.shm)  # the name goes now; the memory when the last mapping does
        with contextlib.suppress(BufferError):  # a tensor still viewing the segment keeps it mapped
            self.shm.close()


    def _wait(self, ready, idle: bool) -> None:
        """Until ``ready()``, yielding the core between checks. Waiting for an order (``idle``)
        backs off to sleeps and has no deadline; a collective fails after the timeout, or at once
        when a rank is known to be gone."""
        spins, deadline = 0, None if idle else time.monotonic() + self.timeout_seconds
        while not ready():
            spins += 1
            if spins < 2000:
                os.sched_yield()
                continue
            if self.failed is not None:
                raise RuntimeError(f"tensor-parallel collective aborted: {self.failed}")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel collective timed out after {self.timeout_seconds:g}s")
            if idle:
                time.sleep(min(1e-3, 1e-5 * (spins - 1999)))
            else:
                os.sched_yield()


def _unlink(shm: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()
