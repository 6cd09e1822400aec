"""The lower tiers together: host memory (LRU within ``--kv-offload-memory``) over the tiers below it
(``lower``: the disk tier, the shared store, or both side by side in a ``TierStack``).

One object, shared in the engine's process by the scheduler's side (``KVTierLink``: which keys
exist, pinning the ones a prefix hit will load) and the driver worker (``apply``: copying blocks
out of and into the KV cache tensors before the step's forward pass). Blocks are kept in the
cache's own format, byte for byte: an int8 or fp8 cache's codes with their scales (the compressed
form, about a quarter of fp32), a float cache as it is, so a block loaded back is the block that
was computed and a tier hit never changes an answer.

Nothing on a step's path waits for the disk: saving copies a block into host memory and queues
its file write for a thread of its own; reading from disk happens either ahead (``prefetch``, while
a request waits in the queue) or, for what the read-ahead has not brought yet, when the scheduler
admits the request (``pin_run``), where it replaces computing that block.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.core.kv_tiers.tier_stack import BlockTier

logger = logging.getLogger(__name__)


@dataclass
class TierCounters:
    """Blocks counted over the engine's life (tokens: times the block size)."""

    memory_hits: int = 0  # promoted from host memory
    disk_hits: int = 0  # promoted from the tiers below memory: disk or the shared store (read ahead or at admission)
    saved: int = 0  # copied out of the KV cache into host memory
    written: int = 0  # files written
    write_errors: int = 0


def _bytes_of(block: torch.Tensor) -> np.ndarray:
    """A block of the cache (strided: a slice of every layer) as a numpy view of its bytes. The copies
    in and out of the cache go through numpy, one thread: torch's copy runs an OpenMP region, and
    beside the tiers' own thread one of its two workers waits for a core, ~10 ms a block against
    ~0.1 ms (a 4,096-token prefix read back from Valkey spent 2.7 of its 5.1 s so)."""
    return block.view(torch.uint8).numpy()


class KVTierStore:
    def __init__(self, memory_bytes: int, lower: BlockTier | None = None) -> None:
        self.memory_bytes = memory_bytes
        self.lower = lower
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._mem: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key → the block's bytes (uint8)
        self.mem_used = 0
        self._pins: dict[bytes, int] = {}  # keys a scheduled load will read: never dropped
        self._unwritten: set[bytes] = set()  # file write queued: never dropped before it is done
        self._transient: set[bytes] = set()  # kept only until written (written through, still in the KV cache)
        self._from_disk: set[bytes] = set()  # read ahead from disk, not yet promoted (counted as disk hits)
        self._kv: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        self.block_nbytes = 0
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        if lower is not None:
            self._thread = threading.Thread(target=self._work, name="pagoda-kv-offload", daemon=True)
            self._thread.start()

    # -- the worker's side ----------------------------------------------------------------------
    def bind(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
        """The KV cache tensors ([2, slots, blocks, heads, block_size, head_dim], and an int8/fp8
        cache's scales) that saves read and loads write."""
        self._kv, self._scales = kv_cache, kv_scales
        self.block_nbytes = self._pack(0).numel()

    def _pack(self, block: int) -> torch.Tensor:
        parts = [_bytes_of(self._kv[:, :, block])]
        if self._scales is not None:
            parts.append(_bytes_of(self._scales[:, :, block]))
        flat = [part.reshape(-1) for part in parts]  # a copy each: the block is strided over the layers
        return torch.from_numpy(flat[0] if len(flat) == 1 else np.concatenate(flat))

    def _unpack_into(self, block: int, raw: torch.Tensor) -> None:
        dst = _bytes_of(self._kv[:, :, block])
        src = raw.numpy()
        dst[...] = src[:dst.size].reshape(dst.shape)
        if self._scales is not None:
            sdst = _bytes_of(self._scales[:, :, block])
            sdst[...] = src[dst.size:].reshape(sdst.shape)

    def apply(self, saves: list[tuple[int, bytes, bool, bool]], loads: list[tuple[bytes, int]]) -> None:
        """Before a step's forward: copy out the blocks to save (``(block, key, keep in memory,
        write down)``: a block the radix tree let go stays in host memory; one written through to
        disk while the tree still holds it is kept only until its file is written), then copy in the
        blocks to load (``(key, block)``; pinned by ``pin_run``). Saves first: a block let go in this
        step may be the target of a load in the same step."""
        for block, key, keep, write in saves:
            with self._lock:
                held = key in self._mem
            raw = None if held else self._pack(block)  # held: no copy out of the cache (a load may not have run)
            with self._lock:
                if held:
                    if keep:  # let go by the tree now: it stays in memory
                        self._transient.discard(key)
                    if write:
                        self._queue_write(key)
                    continue
                self._put(key, raw)
                self.counters.saved += 1
                if not keep:
                    self._transient.add(key)
                if not (write and self._queue_write(key)) and not keep:
                    self._drop(key)
            self._trim()
        for key, block in loads:
            with self._lock:
                raw = self._mem[key]
                self._release_pin(key)
            self._unpack_into(block, raw)

    def _queue_write(self, key: bytes) -> bool:
        """Under the lock: a file write of ``key``'s block queued, unless it is written or queued."""
        if self.lower is None or key in self._unwritten or self.lower.has(key):
            return False
        self._unwritten.add(key)
        self._jobs.put(key)
        return True

    # -- the scheduler's side -------------------------------------------------------------------
    def in_memory(self, key: bytes) -> bool:
        return key in self._mem

    def known(self, key: bytes) -> bool:
        """In host memory or on disk (this process's file, or another replica's)."""
        return key in self._mem or (self.lower is not None and self.lower.has(key))

    def pin_run(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the tiers hold; each of those is brought into host
        memory (read from disk if the read-ahead has not) and pinned until ``apply`` loads it."""
        n = 0
        for key in keys:
            with self._lock:
                raw = self._mem.get(key)
            from_disk = raw is None or key in self._from_disk
            if raw is None:
                raw = self._read(key)
                if raw is None:
                    break
            with self._lock:
                if key not in self._mem:
                    self._put(key, raw)
                self._from_disk.discard(key)
                self._mem.move_to_end(key)
                self._pins[key] = self._pins.get(key, 0) + 1
            if from_disk:
                self.counters.disk_hits += 1
            else:
                self.counters.memory_hits += 1
            n += 1
        self._trim()
        return n

    def prefetch(self, keys: list[bytes]) -> None:
        """Read ahead, in the background, the run of ``keys`` that is on disk and not in memory."""
        if self.lower is not None and keys:
            self._jobs.put(list(keys))

    def _read(self, key: bytes) -> torch.Tensor | None:
        if self.lower is None:
            return None
        payload = self.lower.read(key)
        if payload is None:
            return None
        if len(payload) != self.block_nbytes:
            logger.warning("KV offload: refused block %s: %d bytes, a block of this model is %d",
                           key.hex(), len(payload), self.block_nbytes)
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    # -- memory, under the lock ------------------------------------------------------------------
    def _put(self, key: bytes, raw: torch.Tensor) -> None:
        self._mem[key] = raw
        self.mem_used += raw.numel()

    def _drop(self, key: bytes) -> None:
        self.mem_used -= self._mem.pop(key).numel()
        self._transient.discard(key)
        self._from_disk.discard(key)

    def _release_pin(self, key: bytes) -> None:
        left = self._pins[key] - 1
        if left:
            self._pins[key] = left
        else:
            del self._pins[key]

    def _trim(self) -> None:
        """Drop least recently used blocks past the memory budget (never a pinned or unwritten one)."""
        with self._lock:
            if self.mem_used <= self.memory_bytes:
                return
            for key in list(self._mem):
                if self.mem_used <= self.memory_bytes:
                    return
                if key not in self._pins and key not in self._unwritten:
                    self._drop(key)

    # -- the background thread: file writes and read-ahead -----------------------------------------
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if isinstance(job, list):
                    self._read_ahead(job)
                else:
                    self._write(job)
            except Exception:  # a full disk or a vanished directory costs the tier, never the engine
                logger.exception("KV offload: background job failed")
            finally:
                self._jobs.task_done()

    def _write(self, key: bytes) -> None:
        with self._lock:
            raw = self._mem.get(key)
        try:
            if raw is not None:
                self.lower.write(key, raw.numpy().tobytes())
                self.counters.written += 1
        except OSError as e:
            self.counters.write_errors += 1
            logger.warning("KV offload: could not write block %s: %s", key.hex(), e)
        with self._lock:
            self._unwritten.discard(key)
            if key in self._transient and key not in self._pins and key in self._mem:
                self._drop(key)
        self._trim()

    def _read_ahead(self, keys: list[bytes]) -> None:
        for key in keys:
            if key in self._mem:
                continue
            raw = self._read(key)
            if raw is None:
                return
            with self._lock:
                if key not in self._mem:
                    self._put(key, raw)
                    self._from_disk.add(key)
            self._trim()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write and read-ahead is done (True) or ``timeout`` passes."""
        if self._thread is None:
            return True
        done = threading.Event()
        threading.Thread(target=lambda: (self._jobs.join(), done.set()), daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued file writes (so a restart finds them), then stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self.flush(timeout)
            self._jobs.put(None)
            self._thread.join(timeout)
