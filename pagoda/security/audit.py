"""`--audit-log FILE`: one JSON line per request, rotated by size.

    {"time": "2026-05-01T12:00:00.123Z", "method": "POST", "path": "/v1/chat/completions",
     "client": "10.0.0.7", "tenant": "acme", "key_id": "3f9c0a1b2d4e", "role": "basic",
     "model": "smollm2", "status": 200, "prompt_tokens": 31, "completion_tokens": 64,
     "cached_tokens": 16, "latency_ms": 812.4, "filter_hits": []}

gRPC calls write the same line (`"method": "gRPC"`, `"path": "/pagoda.v1.Engine/<RPC>"`, `status`
the gRPC code's name: grpc_api/service.py's `_audited`).

Written when the request's answer is complete (a stream: when it ends), for every request
except the open paths (/health, /metrics, /version, /docs, /openapi.json), refused ones
included (401, 403, 429: tenant and key id are null for an unknown key). No prompt or output
text unless `--audit-log-content`, which adds "prompts" and "outputs" (lists of strings, by
prompt). `filter_hits` lists what output filters caught (`context.note_filter_hit`).

Rotation: once the file would pass `--audit-log-max-bytes`, it is renamed FILE.1 (FILE.1 →
FILE.2, ..., the oldest of `--audit-log-backups` dropped) and a new FILE started; lines are never
split across files. Lines are written unbuffered-by-line from the event loop (one write of a few
hundred bytes to the page cache, a few µs), in the order requests end. The file is created 0600.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import orjson

logger = logging.getLogger("pagoda.audit")

DEFAULT_MAX_BYTES = 100 * 1024 * 1024
DEFAULT_BACKUPS = 5


class AuditLog:
    def __init__(self, path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS,
                 content: bool = False) -> None:
        if max_bytes < 1024:
            raise ValueError(f"--audit-log-max-bytes must be at least 1024, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"--audit-log-backups must be >= 0, got {backups}")
        self.path = Path(path)
        self.max_bytes, self.backups, self.content = max_bytes, backups, content
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size
        self._failed = False

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def write(self, record: dict) -> None:
        line = orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n"
        try:
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            os.write(self._fd, line)
            self._size += len(line)
            self._failed = False
        except OSError as e:  # a full disk must not fail requests; say so once per failing streak
            if not self._failed:
                logger.error("cannot write the audit log %s: %s", self.path, e)
            self._failed = True

    def _rotate(self) -> None:
        os.close(self._fd)
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._fd = self._open()
        self._size = 0

    def close(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def timestamp(wall: float | None = None) -> str:
    """UTC, milliseconds: 2026-05-01T12:00:00.123Z."""
    moment = datetime.fromtimestamp(time.time() if wall is None else wall, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
