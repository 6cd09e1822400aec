"""Real processes for the router's integration tests: `pagoda serve` replicas of the tiny model
and `pagoda router` in front of them, all on 127.0.0.1. Readiness is polled, never slept for.
The tests import these by this module's own name (a `from conftest import` picks whichever
conftest a run imported first: tests/store's, when both directories run together)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import httpx

from server_process import _free_port, side_by_side, start_server, stop_process

ADMIN_KEY = "admin-secret"


def start_replicas(model_dir, n: int = 2, *extra: str) -> list[tuple[subprocess.Popen, str]]:
    """`n` replicas started side by side (each ~5 s alone)."""
    return side_by_side(*[lambda: start_server(model_dir, *extra)] * n)


def stop(proc: subprocess.Popen) -> None:
    stop_process(proc)


class _FrontProcess:
    """A process whose HTTP front is a router (`pagoda router`, or `pagoda serve
    --data-parallel-size`), on a free port; its log goes to a temporary file (read on failure)."""

    def __init__(self, args: list[str], label: str, timeout: float, wait_healthy: bool = True) -> None:
        self.wait_healthy = wait_healthy  # else: up once it answers at all (503 with no worker available)
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"pagoda-{label}-", suffix=".log")
        cmd = [sys.executable, "-m", "pagoda.cli", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(self._up, timeout=timeout, interval=0.1, what=f"pagoda {args[0]} ({label})")
        except BaseException:
            self.stop()
            raise

    def _up(self) -> bool:
        assert self.proc.poll() is None, f"it exited: {self.output()}"
        try:
            status = httpx.get(f"{self.base}/health", timeout=1).status_code
            return status == 200 or not self.wait_healthy
        except httpx.HTTPError:
            return False

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def workers(self) -> dict[str, dict]:
        """GET /workers, by URL."""
        answer = httpx.get(f"{self.base}/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
        answer.raise_for_status()
        return {w["url"]: w for w in answer.json()["workers"]}

    def stop(self) -> None:
        stop(self.proc)  # SIGTERM: a data-parallel front stops its replicas too
        self.log.close()


class RouterProcess(_FrontProcess):
    """`pagoda router` in front of `workers`."""

    def __init__(self, workers: list[str], *extra: str, wait_healthy: bool = True) -> None:
        super().__init__(["router", "--log-level", "warning", "--health-interval", "0.3", "--admin-key", ADMIN_KEY,
                          *[arg for url in workers for arg in ("--worker", url)], *extra], "router", timeout=60,
                         wait_healthy=wait_healthy)


class DataParallelServe(_FrontProcess):
    """`pagoda serve --data-parallel-size N` of the tiny model (its replicas are its children)."""

    def __init__(self, model_dir, n: int = 2, *extra: str) -> None:
        super().__init__(["serve", "--model", str(model_dir), "--dtype", "float32", "--kv-cache-memory", "0.02",
                          "--served-model-name", "tiny", "--log-level", "warning", "--data-parallel-size", str(n),
                          "--router-admin-key", ADMIN_KEY, "--router-health-interval", "0.3", *extra], "dp",
                         timeout=180)


def wait_for(condition, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    """Poll `condition()` until it returns something truthy (returned), or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


# The tiny Llama with a 16k context, so that a request can be kept running while a test acts.
LONG_CONTEXT = ("--kv-cache-memory", "0.05", "--max-model-len", "16384")
