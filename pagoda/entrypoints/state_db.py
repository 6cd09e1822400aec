"""A server's durable state, in one SQLite file: stored responses and `/v1/sessions`
conversations (so a restart loses no conversation), and the Batch API's files and jobs (so a
restart resumes them). Uploaded files' bytes live beside it, in `files/`.

The state directory is the server's own: by default `$PAGODA_HOME/state/<model name>-<port>`, so
a server restarted with the same model and port finds its state, and two servers never share
one (`--state-dir` names another; `--state-dir none` keeps everything in memory only). One
connection serves the server's threads under a lock: every statement is small, and SQLite's
WAL journal makes each commit durable without blocking readers.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path
from typing import Any

import orjson

from pagoda.home import pagoda_home

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    kind TEXT NOT NULL, tenant TEXT NOT NULL, id TEXT NOT NULL, updated REAL NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (kind, tenant, id));
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (batch_id, line));
"""


def default_state_dir(model_name: str, port: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model_name)
    return pagoda_home() / "state" / f"{safe}-{port}"


class StateDB:
    """Records (a kind, a tenant, an id → a JSON document) and batch results."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.files_dir = self.directory / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.directory / "state.sqlite3", check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _run(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    # -- records -----------------------------------------------------------------------------
    def put(self, kind: str, tenant: str | None, record_id: str, data: Any, updated: float) -> None:
        self._run("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)",
                  (kind, tenant or "", record_id, updated, orjson.dumps(data)))

    def get(self, kind: str, tenant: str | None, record_id: str) -> Any | None:
        rows = self._run("SELECT data FROM records WHERE kind = ? AND tenant = ? AND id = ?",
                         (kind, tenant or "", record_id))
        return orjson.loads(rows[0][0]) if rows else None

    def delete(self, kind: str, tenant: str | None, record_id: str) -> None:
        self._run("DELETE FROM records WHERE kind = ? AND tenant = ? AND id = ?", (kind, tenant or "", record_id))

    def all(self, kind: str) -> list[tuple[str | None, str, Any]]:
        """Every record of a kind: (tenant, id, data), oldest update first."""
        rows = self._run("SELECT tenant, id, data FROM records WHERE kind = ? ORDER BY updated", (kind,))
        return [(tenant or None, record_id, orjson.loads(data)) for tenant, record_id, data in rows]

    def listing(self, kind: str, tenant: str | None) -> list[Any]:
        """A tenant's records of a kind, newest first."""
        rows = self._run("SELECT data FROM records WHERE kind = ? AND tenant = ? ORDER BY updated DESC",
                         (kind, tenant or ""))
        return [orjson.loads(data) for (data,) in rows]

    def keep_newest(self, kind: str, count: int) -> None:
        self._run("DELETE FROM records WHERE kind = ? AND rowid NOT IN (SELECT rowid FROM records WHERE kind = ? "
                  "ORDER BY updated DESC LIMIT ?)", (kind, kind, count))

    # -- batch results -----------------------------------------------------------------------
    def put_result(self, batch_id: str, line: int, ok: bool, data: Any) -> None:
        self._run("INSERT OR REPLACE INTO batch_results VALUES (?, ?, ?, ?)",
                  (batch_id, line, int(ok), orjson.dumps(data)))

    def results(self, batch_id: str) -> list[tuple[int, bool, Any]]:
        rows = self._run("SELECT line, ok, data FROM batch_results WHERE batch_id = ? ORDER BY line", (batch_id,))
        return [(line, bool(ok), orjson.loads(data)) for line, ok, data in rows]

    def result_counts(self, batch_id: str) -> tuple[int, int]:
        """(lines answered, lines refused) so far, counted without reading the answers."""
        rows = self._run("SELECT COALESCE(SUM(ok), 0), COUNT(*) FROM batch_results WHERE batch_id = ?", (batch_id,))
        completed, total = rows[0]
        return completed, total - completed

    def done_lines(self, batch_id: str) -> set[int]:
        return {line for (line,) in self._run("SELECT line FROM batch_results WHERE batch_id = ?", (batch_id,))}

    def drop_results(self, batch_id: str) -> None:
        self._run("DELETE FROM batch_results WHERE batch_id = ?", (batch_id,))
