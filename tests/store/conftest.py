"""Fixtures for the model store: a tiny GGUF, a fresh `$PAGODA_HOME` per test (sharing the suite's
kernels and conversions), and a real OCI registry (the CNCF distribution registry, Debian's
`docker-registry`, started by pagoda/bench/registry_process.py on 127.0.0.1 with a temporary
storage directory), plus a small proxy in front of it that can cut a blob download short or
demand a bearer token."""

from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from gguf_export import export_gguf

from pagoda.bench.registry_process import RegistryNotInstalled, RegistryProcess, start_registry


@pytest.fixture(scope="session")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama (tests/tiny_models.py) as a Q8_0 GGUF, with its ChatML template."""
    return export_gguf(tiny_llama, tmp_path_factory.mktemp("store-gguf") / "tiny.gguf", "Q8_0")


def _start_registry(tmp: Path, htpasswd: Path | None = None) -> RegistryProcess:
    try:
        return start_registry(tmp, htpasswd)
    except RegistryNotInstalled as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with _start_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


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
    with _start_registry(tmp, tmp / "htpasswd") as reg:
        yield reg


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
