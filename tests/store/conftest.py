"""Fixtures for the model store: a tiny GGUF, a fresh `$PAGODA_HOME` per test (sharing the suite's
kernels and conversions), and a real OCI registry (the CNCF distribution registry, Debian's
`docker-registry`) started on 127.0.0.1 with a temporary storage directory, plus a small proxy in
front of it that can cut a blob download short or demand a bearer token."""

from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from gguf_export import export_gguf
from server_process import _free_port, stop_process

REGISTRY_BIN = shutil.which("docker-registry") or shutil.which("registry")


@pytest.fixture(scope="session")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama (tests/tiny_models.py) as a Q8_0 GGUF, with its ChatML template."""
    return export_gguf(tiny_llama, tmp_path_factory.mktemp("store-gguf") / "tiny.gguf", "Q8_0")


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, deadline: float = 30.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code in (200, 401):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"docker-registry did not answer {url} within {deadline} s: {log.read_text()[-2000:]}")


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    root: Path  # its storage directory
    proc: subprocess.Popen

    def blob_data_path(self, digest: str) -> Path:
        hexdigest = digest.split(":", 1)[1]
        return self.root / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"


def _start_registry(tmp: Path, htpasswd: Path | None = None) -> Registry:
    if REGISTRY_BIN is None:
        pytest.skip("docker-registry is not installed (apt-get install docker-registry; .ci/run installs it)")
    port = _free_port()
    data = tmp / "data"
    data.mkdir(parents=True)
    auth = (f"auth:\n  htpasswd:\n    realm: pagoda-test\n    path: {htpasswd}\n" if htpasswd else "")
    config = tmp / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {data}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n" + auth
    )
    log = tmp / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/v2/", proc, log)
    except Exception:
        proc.kill()
        raise
    return Registry(f"127.0.0.1:{port}", data, proc)


def _stop(proc: subprocess.Popen) -> None:
    stop_process(proc, timeout=10)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = _start_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    _stop(reg.proc)


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    """A registry that wants basic auth (htpasswd, bcrypt as the registry requires; made with
    apache2-utils' htpasswd)."""
    htpasswd_bin = shutil.which("htpasswd")
    if htpasswd_bin is None:
        pytest.skip("htpasswd (apache2-utils) is not installed")
    tmp = tmp_path_factory.mktemp("auth-registry")
    entry = subprocess.run([htpasswd_bin, "-Bbn", "alice", "s3cret"], capture_output=True, text=True, check=True)
    (tmp / "htpasswd").write_text(entry.stdout.strip() + "\n")
    reg = _start_registry(tmp, tmp / "htpasswd")
    yield reg
    _stop(reg.proc)


@dataclass
class Proxy:
    """An HTTP proxy to the registry. `cut_blob_after`: the next blob GET sends that many bytes of
    the body and drops the connection (once). `bearer`: demand `Authorization: Bearer <token>`,
    handed out by its own /token endpoint for basic credentials alice:s3cret."""

    upstream: str
    port: int = 0
    cut_blob_after: int | None = None
    bearer: str | None = None
    requests: list[tuple[str, str, dict]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"


def _handler(proxy: Proxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _forward(self) -> None:
            headers = {k: v for k, v in self.headers.items()}
            proxy.requests.append((self.command, self.path, headers))
            if proxy.bearer is not None:
                if self.path.startswith("/token"):
                    expected = "Basic " + base64.b64encode(b"alice:s3cret").decode()
                    ok = headers.get("Authorization") == expected
                    body = (b'{"token": "%s"}' % proxy.bearer.encode()) if ok else b'{"error": "bad credentials"}'
                    self._reply(200 if ok else 401, body, {"Content-Type": "application/json"})
                    return
                if headers.get("Authorization") != f"Bearer {proxy.bearer}":
                    challenge = (f'Bearer realm="http://{proxy.host}/token",service="test",'
                                 f'scope="repository:x:pull,push"')
                    self._reply(401, b'{"errors": []}', {"WWW-Authenticate": challenge,
                                                          "Content-Type": "application/json"})
                    return
                headers.pop("Authorization")
            length = int(headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers.pop("Host", None)
            with httpx.Client(timeout=30) as client:
                with client.stream(self.command, f"http://{proxy.upstream}{self.path}", headers=headers,
                                   content=body) as response:
                    cut = (proxy.cut_blob_after if self.command == "GET" and "/blobs/" in self.path
                           and response.status_code in (200, 206) else None)
                    self.send_response(response.status_code)
                    for key, value in response.headers.items():
                        if key.lower() == "location":  # uploads continue through the proxy
                            value = value.replace(proxy.upstream, proxy.host)
                        if key.lower() not in ("transfer-encoding", "connection"):
                            self.send_header(key, value)
                    self.end_headers()
                    if self.command == "HEAD":
                        return
                    sent = 0
                    for chunk in response.iter_raw():
                        if cut is not None and sent + len(chunk) >= cut:
                            self.wfile.write(chunk[:cut - sent])
                            self.wfile.flush()
                            proxy.cut_blob_after = None
                            self.close_connection = True
                            self.connection.shutdown(socket.SHUT_RDWR)
                            return
                        self.wfile.write(chunk)
                        sent += len(chunk)

        def _reply(self, status: int, body: bytes, headers: dict) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    return Handler


@pytest.fixture
def proxy(registry):
    p = Proxy(registry.host)
    p.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(p))
    p.port = p.server.server_address[1]
    thread = threading.Thread(target=p.server.serve_forever, daemon=True)
    thread.start()
    yield p
    p.server.shutdown()
    p.server.server_close()
