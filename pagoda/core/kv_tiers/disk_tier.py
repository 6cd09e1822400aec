"""The disk tier: one file a KV block under ``--kv-offload-dir``, LRU within a size budget.

A file is written whole or not at all: to a temporary file (0600) in the same directory, fsynced,
then renamed over its name, so a reader (this process after a restart, or another replica sharing
the directory) sees the old state or the new, never half a block. A file is still checked on every
read: its header names the key it holds (a file copied under another name is foreign), the payload's
length and a SHA-256 of it (a torn or corrupted file fails), and, for an encrypted model, AES-GCM
authenticates the payload under a key derived from the model's. A file that fails any check is
refused with a log line and removed, never served.

Layout: ``DIR/ab/<32 hex>.kv``; the header is MAGIC, a flags byte (1: encrypted), the key, the
payload's length (8 bytes, little-endian) and its SHA-256; then the payload.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path

from pagoda.core.kv_tiers.block_hash import KEY_BYTES

logger = logging.getLogger(__name__)

MAGIC = b"PGKV\x01"
_HEADER = struct.Struct(f"<5sB{KEY_BYTES}sQ32s")
ENCRYPTED = 1


class KVCipher:
    """AES-256-GCM under a key of its own (an encrypted model's KV is sealed with the model's key:
    ``kv_key_from_model_key``). The block's key is the associated data, so a sealed payload moved
    under another name does not open."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # cryptography loads only for encrypted models

        if len(key) != 32:
            raise ValueError(f"a KV cipher key is 32 bytes, got {len(key)}")
        self._aes = AESGCM(key)

    def seal(self, key: bytes, payload: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aes.encrypt(nonce, payload, key)

    def open(self, key: bytes, sealed: bytes) -> bytes:
        return self._aes.decrypt(sealed[:12], sealed[12:], key)  # raises InvalidTag when tampered


def kv_key_from_model_key(secret: bytes, container_digest: str) -> bytes:
    """A key for the KV of one encrypted model: derived from its key (raw or passphrase) and its
    container's header digest, so the model key itself never encrypts anything else."""
    return hashlib.scrypt(secret, salt=b"pagoda-kv-offload\0" + container_digest.encode(), n=2**14, r=8, p=1,
                          dklen=32)


class DiskTier:
    """Blocks in files, least recently used removed first once the directory holds ``budget_bytes``.

    The index of files (key → size, LRU order) is rebuilt from the directory at start (oldest
    modification first); a file another replica wrote is found by its name when looked up."""

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, cipher: KVCipher | None = None) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {str(self.dir)!r}: cannot create it: {e}") from None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offload_dir {str(self.dir)!r} is not writable")
        self.budget_bytes = budget_bytes
        self.cipher = cipher
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, int] = OrderedDict()
        self.used_bytes = 0
        self.num_refused = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        for path in self.dir.glob("*/*.kv"):
            try:
                st = path.stat()
                found.append((st.st_mtime_ns, bytes.fromhex(path.stem), st.st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(found):
            self._files[key] = size
            self.used_bytes += size

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / f"{name}.kv"

    def has(self, key: bytes) -> bool:
        """Whether a file for ``key`` exists (this process's or another replica's)."""
        with self._lock:
            if key in self._files:
                return True
        return self.path(key).exists()

    def write(self, key: bytes, payload: bytes) -> None:
        """Store ``payload`` under ``key``: temp file, fsync, rename (atomic), 0600."""
        if self.cipher is not None:
            payload = self.cipher.seal(key, payload)
        data = _HEADER.pack(MAGIC, ENCRYPTED if self.cipher else 0, key, len(payload),
                            hashlib.sha256(payload).digest()) + payload
        path = self.path(key)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # concurrent writers of one key write the same block: the last rename wins
        with self._lock:
            self.used_bytes += len(data) - self._files.pop(key, 0)
            self._files[key] = len(data)
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
        problem = self._check(key, data)
        if problem is not None:
            self.num_refused += 1
            logger.warning("KV offload: refused %s: %s; removing it", path, problem)
            self._remove(key)
            return None
        payload = data[_HEADER.size:]
        if self.cipher is not None:
            try:
                payload = self.cipher.open(key, payload)
            except Exception:  # InvalidTag: another key, or tampered after its checksum was made
                self.num_refused += 1
                logger.warning("KV offload: refused %s: it does not decrypt with this model's key; removing it", path)
                self._remove(key)
                return None
        try:
            os.utime(path)  # least recently used order survives a restart
        except OSError:
            pass
        with self._lock:
            if key not in self._files:
                self.used_bytes += len(data)
            self._files[key] = len(data)
            self._files.move_to_end(key)
        return payload

    def _check(self, key: bytes, data: bytes) -> str | None:
        """Why a file's bytes are not a block of ``key`` (None: they are)."""
        if len(data) < _HEADER.size or data[:len(MAGIC)] != MAGIC:
            return "not a pagoda KV block file (bad magic or too short)"
        _, flags, stored_key, length, digest = _HEADER.unpack_from(data)
        if stored_key != key:
            return "foreign file: its header names another block"
        if bool(flags & ENCRYPTED) != (self.cipher is not None):
            return "encrypted for another model" if flags & ENCRYPTED else "not encrypted, but this model's KV is"
        payload = memoryview(data)[_HEADER.size:]
        if len(payload) != length:
            return f"torn write: {len(payload)} payload bytes of {length}"
        if hashlib.sha256(payload).digest() != digest:
            return "checksum mismatch (corrupted)"
        return None

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
        """Remove least recently used files until the directory is within its budget."""
        while True:
            with self._lock:
                if self.used_bytes <= self.budget_bytes or not self._files:
                    return
                key = next(iter(self._files))
            self._remove(key)
