"""A real Valkey (or Redis) server for the tests of the shared KV store, on a free port.

Debian's ``valkey-server`` or ``redis-server`` (.ci/run installs it); absent, the tests that need it
are skipped. Nothing is persisted (``--save ""``), and the server evicts by LRU within its
``maxmemory`` as a production one would be told to.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary() -> str | None:
    return shutil.which("valkey-server") or shutil.which("redis-server")


def start_valkey(directory, maxmemory: str = "256mb") -> tuple[subprocess.Popen, str]:
    """(process, redis:// URL) once the server answers PING; skips the test without a server."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server (apt-get install valkey-server or redis-server; .ci/run does)")
    redis = pytest.importorskip("redis")
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(directory), "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}"
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{binary} exited with {proc.returncode}")
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)  # polling for readiness, not waiting for a result
    proc.kill()
    raise RuntimeError(f"{binary} did not answer PING")


def stop_valkey(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
