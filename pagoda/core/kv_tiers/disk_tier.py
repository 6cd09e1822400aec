"""The disk tier: one file a KV block under ``--kv-offload-dir``, LRU within a size budget.

A file is written whole or not at all: to a temporary file (0600, a name no other writer uses) in
the same directory, fsynced, then renamed over its name, so a reader (this process after a restart,
or another replica sharing the directory) sees the old state or the new, never half a block. A file
is still checked on every read (``block_format``): a file that is torn, corrupted, foreign or
sealed for another model is refused with a log line and removed, never served.

Several replicas may share the directory (one host, or a shared filesystem). The directory itself
is the shared state: a file's modification time is its last use (a read touches it), a block
another replica wrote is found by its name, and the budget is the directory's, not one process's:
a replica lists the directory again every ``RESCAN_SECONDS`` and whenever it finds itself over
budget, then removes the least recently used files of any replica. Two replicas trimming at once
may remove a little more than needed, never a file being written (it is renamed into place whole).

Layout: ``DIR/ab/<32 hex>.kv``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from pagoda.core.kv_tiers import block_format
from pagoda.core.kv_tiers.block_format import KVCipher

logger = logging.getLogger(__name__)

RESCAN_SECONDS = 10.0  # how stale one replica's view of a shared directory's size may get
LOW_WATER = 0.9  # over budget, trim to this part of it: a full directory is not listed again at every write
STALE_TEMP_SECONDS = 3600.0  # a temporary file this old is a writer's that was killed: removed on a scan


class DiskTier:
    """Blocks in files, least recently used removed first once the directory holds ``budget_bytes``."""

    name = "disk"

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, cipher: KVCipher | None = None,
                 rescan_seconds: float = RESCAN_SECONDS) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {str(self.dir)!r}: cannot create it: {e}") from None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offload_dir {str(self.dir)!r} is not writable")
        self.budget_bytes = budget_bytes
        self.cipher = cipher
        self.rescan_seconds = rescan_seconds
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # key → size, least recently used first
        self.used_bytes = 0
        self.num_refused = 0
        self.num_hits = 0  # blocks read back whole
        self._scanned_at = 0.0
        self.rescan()

    def rescan(self) -> None:
        """Rebuild the index from the directory (every replica's files, oldest use first)."""
        found, now = [], time.time()
        for path in self.dir.glob("*/*"):
            try:
                st = path.stat()
                if path.suffix == ".tmp":
                    if now - st.st_mtime > STALE_TEMP_SECONDS:
                        path.unlink()
                    continue
                if path.suffix == ".kv":
                    found.append((st.st_mtime_ns, bytes.fromhex(path.stem), st.st_size))
            except (OSError, ValueError):
                continue  # removed by another replica meanwhile, or not one of ours
        files = OrderedDict((key, size) for _, key, size in sorted(found))
        with self._lock:
            self._files, self.used_bytes = files, sum(files.values())
            self._scanned_at = time.monotonic()

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}.kv"

    def has(self, key: bytes) -> bool:
        """Whether a file for ``key`` exists (this process's or another replica's, written any time;
        the directory, not this process's index, is the truth: another replica may have removed it)."""
        return self.path(key).exists()

    def write(self, key: bytes, payload: bytes) -> None:
        """Store ``payload`` under ``key``: temp file, rename (atomic), 0600. No fsync: a process
        killed mid-write leaves only its temp file (what it wrote is in the page cache either way),
        and a block a power loss cuts short or leaves stale fails the header's length and SHA-256
        check and is refused; a cache may lose blocks, and the fsyncs cost a written-through block
        about twice the CPU (docs: benchmarks/README.md, "KV tiers")."""
        data = block_format.encode(key, payload, self.cipher)
        path = self.path(key)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        # pid and thread are unique on one host, the random part across hosts on a shared filesystem
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{os.urandom(4).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)  # concurrent writers of one key write the same block: the last rename wins
        with self._lock:
            self.used_bytes += len(data) - self._files.pop(key, 0)
            self._files[key] = len(data)
            stale = time.monotonic() - self._scanned_at >= self.rescan_seconds
        if stale:
            self.rescan()  # learn what other replicas wrote and removed
        self._trim()

    def read(self, key: bytes) -> bytes | None:
        """The payload stored under ``key``, or None: no file, or one that fails a check (refused
        with a log line and removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(key)
            return None
        payload, why = block_format.decode(key, data, self.cipher)
        if payload is None:
            self.num_refused += 1
            logger.warning("KV offload: refused %s: %s; removing it", path, why)
            self._remove(key)
            return None
        try:
            os.utime(path)  # least recently used order survives a restart and is shared by replicas
        except OSError:
            pass
        with self._lock:
            if key not in self._files:
                self.used_bytes += len(data)
            self._files[key] = len(data)
            self._files.move_to_end(key)
            self.num_hits += 1
        return payload

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self.used_bytes -= self._files.pop(key, 0)

    def _remove(self, key: bytes) -> None:
        self._forget(key)
        try:
            self.path(key).unlink()
        except OSError:
            pass  # another replica removed it first

    def _trim(self) -> None:
        """Over budget: list the directory (so the files removed are the oldest of every replica's),
        then remove least recently used files down to ``LOW_WATER`` of the budget."""
        if self.used_bytes <= self.budget_bytes:
            return
        self.rescan()
        while True:
            with self._lock:
                if self.used_bytes <= self.budget_bytes * LOW_WATER or not self._files:
                    return
                key = next(iter(self._files))
            self._remove(key)
