"""What an operator relies on, against real `pagoda serve` processes on 127.0.0.1: a client that
goes away stops its request, --request-timeout bounds a request's life, SIGTERM drains and
exits 0, a killed engine process fails its requests with 503 and is restarted, a busy port
fails before the model loads. Every wait polls the server's own state with a deadline."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagoda.bench.servers import scrape_metrics, wait_idle
from server_process import engine_pids, start_server

LONG = 15000  # tokens: minutes of work on the tiny model, so only an abort ends it early


@pytest.fixture(scope="module")
def long_model(long_tiny_llama) -> Path:
    return long_tiny_llama


def _serve(model: Path, *extra: str):
    return start_server(model, "--kv-cache-memory", "0.05", "--max-model-len", "16384", *extra)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(long_model):
    proc, base = _serve(long_model)
    yield base
    _stop(proc)


def metric(base: str, name: str) -> float:
    """One `pagoda:` metric of the server, summed over labels (`request_success_total:abort`: by
    finish reason); 0 for one not reported yet."""
    return scrape_metrics(base).get(f"pagoda:{name}", 0.0)


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Response:
    def __init__(self, raw: bytes) -> None:
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        self.status_code = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        self.text = (_dechunk(body) if self.headers.get("transfer-encoding") == "chunked" else body).decode()

    def json(self):
        return json.loads(self.text)


def _dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return out


class Background:
    """One HTTP request over a plain socket on its own thread, so the test can act while it is in
    flight, and close the connection as a client that goes away does (curl -m, a read timeout)."""

    def __init__(self, base: str, path: str, body: dict, stream: bool = False):
        host, port = base.removeprefix("http://").split(":")
        payload = json.dumps({**body, "stream": stream}).encode()
        self.sock = socket.create_connection((host, int(port)), timeout=300)
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        self.raw = b""
        self.result: Response | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.raw += chunk
        except OSError:
            return
        if self.raw:
            self.result = Response(self.raw)

    @property
    def text(self) -> str:
        return self.result.text if self.result else ""

    def close(self) -> None:
        """The client goes away: its connection is closed mid-request."""
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def join(self, timeout: float = 60) -> "Background":
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "request did not end"
        return self


def _long(prompt: str = "hello", n: int = 1, max_tokens: int = LONG) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "n": n}


def _long_chat(n: int = 1) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
            "ignore_eos": True, "n": n}


# -- a client that goes away ------------------------------------------------------------------
@pytest.mark.parametrize("path,body,stream", [
    ("/v1/completions", _long(), False),
    ("/v1/chat/completions", _long_chat(), False),
    ("/v1/completions", _long(n=3), False),
    ("/v1/chat/completions", _long_chat(n=2), True),
    ("/v1/completions", _long(), True),
], ids=["completion", "chat", "completion-n3", "chat-stream-n2", "completion-stream"])
def test_disconnect_aborts_and_frees_blocks(server, path, body, stream):
    wait_idle(server)
    generated = metric(server, "generation_tokens_total")
    aborts = metric(server, "request_success_total:abort")
    errors = metric(server, "request_success_total:error")
    request = Background(server, path, body, stream=stream)
    wait_for(lambda: metric(server, "num_requests_running") == body["n"], what="the request to run")
    request.close()
    wait_idle(server)
    request.join()
    assert metric(server, "generation_tokens_total") - generated < LONG, "the request ran on instead of stopping"
    # Each prompt of the request is one abort, never an error.
    assert metric(server, "request_success_total:abort") == aborts + 1
    assert metric(server, "request_success_total:error") == errors


def test_server_serves_others_after_disconnects(server):
    out = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "Paris", "max_tokens": 5, "ignore_eos": True}, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 5


# -- the request timeout and a queued request -------------------------------------------------
@pytest.fixture(scope="module")
def timeout_server(long_model):
    proc, base = _serve(long_model, "--request-timeout", "3", "--max-num-seqs", "1")
    yield base
    _stop(proc)


def test_request_timeout_and_queued_disconnect(timeout_server):
    base = timeout_server
    running = Background(base, "/v1/completions", _long())
    wait_for(lambda: metric(base, "num_requests_running") == 1, what="the first request to run")
    queued = Background(base, "/v1/chat/completions", _long_chat())
    wait_for(lambda: metric(base, "num_requests_waiting") == 1, what="the second request to queue")
    queued.close()  # gone while still waiting for a sequence slot
    wait_for(lambda: metric(base, "num_requests_waiting") == 0, what="the queued request to leave")
    assert metric(base, "num_requests_running") == 1

    response = running.join().result
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "request_timeout" and "timeout" in error["message"]
    assert response.headers["x-should-retry"] == "false"
    wait_idle(base)


def test_request_timeout_ends_a_stream_with_an_error_event(timeout_server):
    request = Background(timeout_server, "/v1/completions", _long(), stream=True).join()
    events = [line.removeprefix("data: ") for line in request.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3, "tokens streamed before the timeout"
    wait_idle(timeout_server)


# -- shutdown ---------------------------------------------------------------------------------
def _refused(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 503
    except (httpx.ConnectError, httpx.RemoteProtocolError):  # closed, or closing the connection unanswered
        return True


def test_sigterm_drains_then_aborts_and_exits_zero(long_model):
    proc, base = _serve(long_model, "--shutdown-timeout", "8")
    try:
        short = Background(base, "/v1/completions", _long("short", max_tokens=1500))
        endless = Background(base, "/v1/completions", _long("endless"), stream=True)
        wait_for(lambda: metric(base, "num_requests_running") == 2, what="both requests to run")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: _refused(base), timeout=10, what="the server to stop accepting")
        # The short request finishes normally inside the drain period ...
        done = short.join().result
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 1500
        # ... the endless one is aborted at its end, its stream closed with an error event.
        endless.join()
        events = [e.removeprefix("data: ") for e in endless.text.splitlines() if e.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert proc.wait(timeout=30) == 0
    finally:
        _stop(proc)


def _engine_pid(server_pid: int) -> int:
    pids = engine_pids(server_pid)
    assert len(pids) == 1, f"expected one engine process, found {pids}"
    return pids[0]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_second_signal_exits_at_once_and_engine_process_exits(long_model):
    proc, base = _serve(long_model, "--engine-process", "--shutdown-timeout", "600")
    try:
        engine = _engine_pid(proc.pid)
        request = Background(base, "/v1/completions", _long(), stream=True)
        wait_for(lambda: metric(base, "num_requests_running") == 1, what="the request to run")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: _refused(base), timeout=10, what="the server to stop accepting")
        assert request.thread.is_alive(), "the first signal must let the request go on"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0  # far sooner than the 600 s drain
        request.join()
        assert "shutting_down" in request.text
        wait_for(lambda: _gone(engine), timeout=15, what="the engine process to exit")
    finally:
        _stop(proc)


# -- chaos: the engine process is killed ------------------------------------------------------
def test_killed_engine_process_fails_requests_then_restarts(long_model):
    proc, base = _serve(long_model, "--engine-process", "--max-engine-restarts", "1")
    try:
        requests = [Background(base, "/v1/completions", _long(f"p{i}")) for i in range(3)]
        wait_for(lambda: metric(base, "num_requests_running") == 3, what="the requests to run")
        os.kill(_engine_pid(proc.pid), signal.SIGKILL)
        for r in requests:
            response = r.join(timeout=30).result
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "engine_unavailable"
        health = httpx.get(f"{base}/health", timeout=10)
        # Either still restarting (503 naming it) or already back.
        assert health.status_code == 200 or health.json()["error"]["code"] == "engine_restarting"
        wait_for(lambda: httpx.get(f"{base}/health", timeout=10).status_code == 200, what="the restart")
        ok = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4

        # The restart budget (1) is spent: the next death is final.
        os.kill(_engine_pid(proc.pid), signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{base}/health", timeout=10).status_code == 503, what="health to turn 503")
        assert httpx.get(f"{base}/health", timeout=10).json()["error"]["code"] == "engine_dead"
        refused = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503
    finally:
        _stop(proc)


# -- start-up ---------------------------------------------------------------------------------
def test_busy_port_fails_before_loading(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pagoda.cli", "serve", "--model", str(tiny_llama),
                              "--port", str(port), "--dtype", "float32"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr
    assert "loaded" not in out.stdout  # it failed before loading the model
    assert time.monotonic() - start < 60


def test_kernels_are_loaded_before_the_engine_is_ready(tiny_llama):
    """LLM(...) returns with the C++ kernels built and loaded: no request pays for the compiler."""
    code = ("from pagoda import LLM; from pagoda.layers import cpu_kernels; "
            f"LLM(model={str(tiny_llama)!r}, dtype='float32', kv_cache_memory=0.02); "
            "print(cpu_kernels._build.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "1"
