"""Start `pagoda serve` as a real subprocess on a free 127.0.0.1 port, for tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import httpx

T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, *extra: str, launcher: list[str] | None = None, name: str | None = "tiny",
                 port: int | None = None, scheme: str = "http", verify=True, bare: bool = False):
    """(process, base URL) once /health answers; a tiny fp32 engine unless `extra` says otherwise.
    On a free port unless `port` is given (a replica restarted where it was). A server over TLS
    (`--ssl-*` in `extra`) takes scheme="https" and what httpx should `verify` it with. `name`
    None: no --served-model-name (several models give their own in `extra`). `bare`: no engine
    flags but the port and `extra` (the model as `pagoda serve --model DIR` serves it)."""
    port = port or _free_port()
    launcher = launcher or ["-m", "pagoda.cli"]
    names = ["--served-model-name", name] if name is not None else []
    model = ["--model", str(model_dir)] if model_dir is not None else []  # None: --models-file in `extra`
    engine = [] if bare else ["--dtype", "float32", "--kv-cache-memory", "0.02", *names, "--log-level", "warning"]
    cmd = [sys.executable, *launcher, "serve", *model, "--port", str(port), *engine, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    base = f"{scheme}://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1, verify=verify).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not come up")


def side_by_side(*starts: Callable[[], T]) -> list[T]:
    """Each `start()` (a server start, ~5 s alone) on its own thread; their results in order."""
    with ThreadPoolExecutor(len(starts)) as pool:
        return [future.result() for future in [pool.submit(start) for start in starts]]


def kill_all(started: list[tuple[subprocess.Popen, str]]) -> None:
    """SIGKILL and reap `side_by_side`'s servers (a fixture's teardown that need not drain)."""
    for proc, _ in started:
        proc.kill()
        proc.wait()


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (read from /proc)."""
    from pathlib import Path

    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def engine_pids(server_pid: int) -> list[int]:
    """The `--engine-process` engine(s) of a server: its spawned multiprocessing children."""
    from pathlib import Path

    found = []
    for child in child_pids(server_pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (a server drains and exits), then SIGKILL if it has not exited within `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def background_load(base: str, path: str, bodies: list[dict], headers: dict | None = None) -> Iterator[None]:
    """While the block runs, post `bodies` to `path` all at once, again and again (a load that a
    page or a metric can be watched under); the last round finishes before the block exits."""
    done = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
            while not done.is_set():
                threads = [threading.Thread(target=client.post, args=(path,), kwargs={"json": body}) for body in bodies]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        yield
    finally:
        done.set()
        loader.join(timeout=120)


class OpenStream:
    """A streamed completion read on a thread, kept running (ignore_eos) so that a test can act on
    the server while it is in flight: its `data:` payloads so far, and how it ended."""

    def __init__(self, base: str, max_tokens: int = 15000, model: str = "tiny") -> None:
        self.events: list[str] = []
        self.error: Exception | None = None
        self.ended_at: float | None = None
        body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self._thread.start()

    def _read(self, base: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
        except httpx.HTTPError as e:  # a cut connection: what a stream must not end with
            self.error = e
        self.ended_at = time.monotonic()

    def wait_started(self, events: int = 3, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < events:
            assert self._thread.is_alive() and time.monotonic() < deadline, f"the stream did not start: {self.events}"
            time.sleep(0.05)

    def join(self, timeout: float = 60) -> "OpenStream":
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        return self

    def error_code(self) -> str | None:
        """The code of the error event before `data: [DONE]` (None if it did not end that way)."""
        if self.error is not None or len(self.events) < 2 or self.events[-1] != "[DONE]":
            return None
        return json.loads(self.events[-2]).get("error", {}).get("code")
