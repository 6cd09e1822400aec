"""The registry client against hostile hosts (small HTTP servers on 127.0.0.1 that record what
they are sent): the credentials reach only the registry's own origin (not a plain-http token
realm on another port, not a redirect's or an upload Location's host), and a manifest over
4 MiB is refused without being read."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagoda.store import blobs, manifests
from pagoda.store.layout import default_layout, parse_ref
from pagoda.store.oci_client import RegistryClient, RegistryError

CREDENTIALS = ("alice", "s3cret")
BASIC = "Basic " + base64.b64encode(b"alice:s3cret").decode()
CONFIG, MODEL = b'{"model_format":"gguf"}', b"weights" * 1000

# What a route answers: (status, headers, body); a body may be an iterable of chunks (streamed).
Answer = tuple[int, dict[str, str], bytes | Iterable[bytes]]


@dataclass
class Host:
    """A server recording every request as (method, path, Authorization header or None)."""

    route: Callable[[BaseHTTPRequestHandler], Answer]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    bytes_sent: int = 0

    def start(self) -> Host:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def authorizations(self) -> list[str]:
        return [auth for _, _, auth in self.requests if auth is not None]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(host: Host):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _serve(self) -> None:
            host.requests.append((self.command, self.path, self.headers.get("Authorization")))
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            status, headers, body = host.route(self)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if isinstance(body, bytes):
                self.send_header("Content-Length", str(len(body)))
            elif "Content-Length" not in headers:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if self.command == "HEAD":
                return
            try:
                self._write(body, chunked=not isinstance(body, bytes) and "Content-Length" not in headers)
            except OSError:  # the client hung up, as it should on an oversize body
                self.close_connection = True

        def _write(self, body: bytes | Iterable[bytes], chunked: bool) -> None:
            for chunk in [body] if isinstance(body, bytes) else body:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                host.bytes_sent += len(chunk)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = _serve

    return Handler


@pytest.fixture
def hosts():
    started: list[Host] = []

    def start(route: Callable[[BaseHTTPRequestHandler], Answer]) -> Host:
        started.append(Host(route).start())
        return started[-1]

    yield start
    for host in started:
        host.stop()


def _manifest() -> manifests.Manifest:
    layers = [manifests.Layer(manifests.MODEL, blobs.digest_bytes(MODEL), len(MODEL))]
    return manifests.Manifest(manifests.Layer(manifests.CONFIG, blobs.digest_bytes(CONFIG), len(CONFIG)), layers)


def _client(registry: Host) -> RegistryClient:
    return RegistryClient(registry.url.removeprefix("http://"), insecure=True, credentials=CREDENTIALS, retries=0)


def _blob_body(path: str) -> bytes:
    return MODEL if blobs.digest_bytes(MODEL) in path else CONFIG


def test_plain_http_token_realm_on_another_port_gets_no_credentials(hosts, fresh_home):
    """Same host, another port, plain http: another origin, asked for an anonymous token."""
    realm = hosts(lambda h: (200, {"Content-Type": "application/json"}, b'{"token": "anon"}'))

    def registry_route(h: BaseHTTPRequestHandler) -> Answer:
        if h.headers.get("Authorization") != "Bearer anon":
            return 401, {"WWW-Authenticate": f'Bearer realm="{realm.url}/token",service="s",scope="x"'}, b"{}"
        if "/manifests/" in h.path:
            return 200, {"Content-Type": manifests.DOCKER_MANIFEST}, _manifest().to_bytes()
        return 200, {}, _blob_body(h.path)

    registry = hosts(registry_route)
    ref = parse_ref(f"{registry.url.removeprefix('http://')}/library/m:1")
    with _client(registry) as client:
        stats = client.pull(default_layout(), ref)
    assert stats.manifest_digest == _manifest().digest
    assert [path.split("?")[0] for _, path, _ in realm.requests] == ["/token"]
    assert realm.authorizations() == []  # before: "Basic YWxpY2U6czNjcmV0", alice's password in the clear


@pytest.mark.parametrize("relative", [False, True], ids=["absolute-location", "relative-location"])
def test_redirect_and_upload_location_on_another_host_get_no_credentials(hosts, fresh_home, relative):
    """Blobs redirected to a CDN-like host are followed without the credentials; an upload the
    registry continues on another host is sent there without them (a relative Location the
    storage host answers is relative to it); a 401 from that host is an error, not a reason to
    send them."""
    cdn_wants_auth = []

    def cdn_route(h: BaseHTTPRequestHandler) -> Answer:
        if cdn_wants_auth:
            return 401, {"WWW-Authenticate": 'Basic realm="cdn"'}, b""
        if h.command == "GET":
            return 200, {}, _blob_body(h.path)
        return (201 if h.command == "PUT" else 202), {"Location": h.path if relative else cdn.url + h.path}, b""

    cdn = hosts(cdn_route)

    def registry_route(h: BaseHTTPRequestHandler) -> Answer:
        if h.headers.get("Authorization") != BASIC:
            return 401, {"WWW-Authenticate": 'Basic realm="registry"'}, b""
        if "/manifests/" in h.path:
            if h.command == "PUT":
                return 201, {}, b""
            return 200, {"Content-Type": manifests.DOCKER_MANIFEST}, _manifest().to_bytes()
        if h.command == "HEAD":
            return 404, {}, b""
        if h.command == "POST":  # an upload that continues on the storage host
            return 202, {"Location": f"{cdn.url}/upload/1"}, b""
        return 307, {"Location": f"{cdn.url}/blob{h.path}"}, b""

    registry = hosts(registry_route)
    ref = parse_ref(f"{registry.url.removeprefix('http://')}/library/m:1")
    layout = default_layout()
    with _client(registry) as client:
        assert client.pull(layout, ref).manifest_digest == _manifest().digest
        assert {method for method, _, _ in cdn.requests} == {"GET"}
        client.push(layout, ref, _manifest(), {})
        assert {method for method, _, _ in cdn.requests} == {"GET", "PATCH", "PUT"}
        assert cdn.authorizations() == []  # before: the PATCH and PUT carried alice's password
        assert registry.authorizations().count(BASIC) >= 4

        cdn_wants_auth.append(True)
        layout.blob_path(_manifest().layers[0].digest).unlink()
        with pytest.raises(RegistryError, match=r"redirected\) wants credentials; they are only sent to"):
            client.pull(layout, ref)
    assert cdn.authorizations() == []


def _oversize_manifest_route(declared: bool) -> Callable[[BaseHTTPRequestHandler], Answer]:
    size = 400 << 20

    def body() -> Iterable[bytes]:
        yield b'{"schemaVersion": 2, "config": {}, "padding": "'
        for _ in range(size >> 20):
            yield b"x" * (1 << 20)

    headers = {"Content-Type": manifests.DOCKER_MANIFEST}
    if declared:
        headers["Content-Length"] = str(size)
    return lambda h: (200, headers, body())


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_400_mib_manifest_is_refused_unread(hosts, declared):
    registry = hosts(_oversize_manifest_route(declared))
    ref = parse_ref(f"{registry.url.removeprefix('http://')}/library/big:1")
    with _client(registry) as client, pytest.raises(RegistryError, match="limit: refused"):
        client.get_manifest(ref)
    assert registry.bytes_sent < 64 << 20  # what the sockets' buffers took before the client hung up


def test_an_oversize_manifest_in_the_store_is_refused(fresh_home):
    layout = default_layout()
    ref = parse_ref("big:1")
    path = layout.manifest_path(ref)
    path.parent.mkdir(parents=True)
    path.write_bytes(json.dumps({"schemaVersion": 2, "pad": "x" * (5 << 20)}).encode())
    with pytest.raises(ValueError, match="a manifest over 4194304 bytes"):
        manifests.read_manifest(layout, ref)


def test_registry_host_scopes_the_environments_credentials(hosts, monkeypatch):
    """With PAGODA_REGISTRY_HOST set, another registry's challenge gets no credentials."""
    registry = hosts(lambda h: (200, {"Content-Type": manifests.DOCKER_MANIFEST}, _manifest().to_bytes())
                     if h.headers.get("Authorization") == BASIC else (401, {"WWW-Authenticate": 'Basic realm="r"'}, b""))
    host = registry.url.removeprefix("http://")
    ref = parse_ref(f"{host}/library/m:1")
    monkeypatch.setenv("PAGODA_REGISTRY_USERNAME", "alice")
    monkeypatch.setenv("PAGODA_REGISTRY_PASSWORD", "s3cret")
    monkeypatch.setenv("PAGODA_REGISTRY_HOST", "registry.example:5000")
    with RegistryClient(host, insecure=True) as client, pytest.raises(RegistryError, match="wants a user name"):
        client.get_manifest(ref)
    assert registry.authorizations() == []
    monkeypatch.setenv("PAGODA_REGISTRY_HOST", host)
    with RegistryClient(host, insecure=True) as client:
        assert client.get_manifest(ref).digest == _manifest().digest
    assert registry.authorizations() == [BASIC]
