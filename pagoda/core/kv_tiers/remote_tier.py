"""The shared store: KV blocks in a Valkey or Redis server (``--kv-offload-url redis://HOST:PORT``),
read and written by every replica that names it, across hosts.

A value is the disk tier's record (``block_format``: the key it holds, a SHA-256 of the payload,
AES-GCM for an encrypted model), under the name ``pagoda:kv:<hex key>``; the keys are the tiers'
chain hashes, so the model, its KV dtype and the tenant's salt hold here as on disk. A value that
fails a check is refused with a log line and deleted. The budget and the eviction are the
server's (``maxmemory`` with ``maxmemory-policy allkeys-lru``): one LRU over every replica's
blocks, with nothing for the replicas to agree on. An unreachable server costs hits, never the
engine: a failed call is a miss (or a write not made), logged once a minute.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pagoda.core.kv_tiers import block_format
from pagoda.core.kv_tiers.block_format import KVCipher

logger = logging.getLogger(__name__)

PREFIX = b"pagoda:kv:"
TIMEOUT_SECONDS = 5.0  # a server that hangs longer costs a miss, not a stuck read-ahead
LOG_EVERY_SECONDS = 60.0


def connect(url: str) -> Any:
    """A client of the server at ``url``, checked with a PING; a ValueError names what is wrong."""
    try:
        import redis  # the redis client loads only with --kv-offload-url (pip install 'pagoda[kv-share]')
    except ImportError:
        raise ValueError("kv_offload_url needs the redis client: pip install 'pagoda[kv-share]' "
                         "(or pip install redis)") from None
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"kv_offload_url {url!r}: expected redis://HOST:PORT (or rediss://, unix://)")
    try:
        client = redis.Redis.from_url(url, socket_timeout=TIMEOUT_SECONDS, socket_connect_timeout=TIMEOUT_SECONDS)
        client.ping()
    except (redis.RedisError, ValueError) as e:
        raise ValueError(f"kv_offload_url {url!r}: cannot reach the server: {e}") from None
    return client


class RemoteTier:
    """Blocks in a Valkey / Redis server shared by replicas (the same interface as ``DiskTier``)."""

    name = "remote"

    def __init__(self, client: Any, cipher: KVCipher | None = None) -> None:
        import redis  # loaded already by connect(); for its error class

        self._client = client
        self._errors = redis.RedisError
        self.cipher = cipher
        self.num_refused = 0
        self.num_hits = 0  # blocks read back whole
        self.num_errors = 0
        self._logged_at = 0.0
        self._lock = threading.Lock()

    @staticmethod
    def _name(key: bytes) -> bytes:
        return PREFIX + key.hex().encode()

    def has(self, key: bytes) -> bool:
        try:
            return bool(self._client.exists(self._name(key)))
        except self._errors as e:
            self._failed("look up", e)
            return False

    def write(self, key: bytes, payload: bytes) -> None:
        try:
            self._client.set(self._name(key), block_format.encode(key, payload, self.cipher))
        except self._errors as e:
            self._failed("write", e)

    def read(self, key: bytes) -> bytes | None:
        """The payload stored under ``key``, or None: none there, the server unreachable, or a value
        that fails a check (refused with a log line and deleted)."""
        try:
            data = self._client.get(self._name(key))
        except self._errors as e:
            self._failed("read", e)
            return None
        if data is None:
            return None
        payload, why = block_format.decode(key, data, self.cipher)
        if payload is None:
            self.num_refused += 1
            logger.warning("KV offload: refused %s from the shared store: %s; deleting it", self._name(key).decode(), why)
            try:
                self._client.delete(self._name(key))
            except self._errors:
                pass
            return None
        with self._lock:
            self.num_hits += 1
        return payload

    def _failed(self, what: str, error: Exception) -> None:
        with self._lock:
            self.num_errors += 1
            now = time.monotonic()
            quiet = now - self._logged_at < LOG_EVERY_SECONDS
            if not quiet:
                self._logged_at = now
        if not quiet:
            logger.warning("KV offload: the shared store failed to %s (%d failures so far): %s",
                           what, self.num_errors, error)
