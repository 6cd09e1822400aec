"""TLS on `pagoda serve` (pagoda/security/tls.py), with certificates made here (`cryptography`):
HTTPS with --ssl-keyfile / --ssl-certfile (the openai SDK over https, trusting the test's CA),
and mutual TLS with --ssl-ca-certs: without a client certificate, or with one from another CA,
the handshake fails; with one the CA signed, HTTP and gRPC (--grpc-port) both work."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import pytest
from server_process import _free_port, kill_all, side_by_side, start_server

from pagoda.security import tls


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer_name, issuer_key, *, ca: bool = False, server: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name or _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _write(directory: Path, stem: str, key, cert) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization

    key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """A CA; a server certificate for 127.0.0.1 and a client certificate it signed; a client
    certificate of another CA."""
    from cryptography.hazmat.primitives.asymmetric import ec

    d = tmp_path_factory.mktemp("pki")
    new_key = lambda: ec.generate_private_key(ec.SECP256R1())  # noqa: E731
    ca_key, rogue_key = new_key(), new_key()
    ca = _issue("pagoda test CA", ca_key, None, None, ca=True)
    rogue = _issue("some other CA", rogue_key, None, None, ca=True)
    server_key, client_key, stranger_key = new_key(), new_key(), new_key()
    return {
        "ca": _write(d, "ca", ca_key, ca),
        "server": _write(d, "server", server_key, _issue("127.0.0.1", server_key, ca.subject, ca_key, server=True)),
        "client": _write(d, "client", client_key, _issue("client", client_key, ca.subject, ca_key)),
        "stranger": _write(d, "stranger", stranger_key, _issue("stranger", stranger_key, rogue.subject, rogue_key)),
    }


def _context(pki, client: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki["ca"][1])
    if client is not None:
        ctx.load_cert_chain(pki[client][1], pki[client][0])
    return ctx


def _start(model_dir, pki, *extra: str, client: str | None = None):
    """`pagoda serve` over TLS: (process, https base URL) once /health answers."""
    key, cert = pki["server"]
    return start_server(model_dir, "--ssl-keyfile", key, "--ssl-certfile", cert, *extra, scheme="https",
                        verify=_context(pki, client))


@pytest.fixture(scope="module")
def servers(tiny_llama, pki):
    """Started side by side: HTTPS; HTTPS + gRPC requiring client certificates of the CA."""
    grpc_port = _free_port()
    mtls = ["--ssl-ca-certs", pki["ca"][1], "--grpc-port", str(grpc_port)]
    started = side_by_side(lambda: _start(tiny_llama, pki), lambda: _start(tiny_llama, pki, *mtls, client="client"))
    yield started[0][1], (started[1][1], grpc_port)
    kill_all(started)


@pytest.fixture(scope="module")
def https_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def mtls_server(servers):
    return servers[1]


def test_the_openai_sdk_over_https(https_server, pki):
    from openai import OpenAI

    client = OpenAI(base_url=f"{https_server}/v1", api_key="unused",
                    http_client=httpx.Client(verify=_context(pki)))
    answer = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # a client that trusts another CA
        httpx.get(f"{https_server}/health", verify=_context({"ca": pki["stranger"]}), timeout=5)
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
        httpx.get(https_server.replace("https://", "http://") + "/health", timeout=5)


def test_mutual_tls_requires_a_client_certificate_the_ca_signed(mtls_server, pki):
    from openai import OpenAI

    base, _ = mtls_server
    refused = (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)
    for client in (None, "stranger"):  # no certificate; one of another CA
        with pytest.raises(refused):
            httpx.get(f"{base}/health", verify=_context(pki, client), timeout=5).raise_for_status()
    sdk = OpenAI(base_url=f"{base}/v1", api_key="unused", http_client=httpx.Client(verify=_context(pki, "client")))
    assert sdk.completions.create(model="tiny", prompt="Hello", max_tokens=3).usage.completion_tokens == 3


def test_grpc_takes_the_same_tls_and_client_certificates(mtls_server, pki):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, port = mtls_server
    ca = Path(pki["ca"][1]).read_bytes()
    key, cert = (Path(p).read_bytes() for p in pki["client"])
    with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert)) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca)) as channel:  # no client cert
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_options_are_checked_before_loading(tmp_path):
    from argparse import Namespace

    key = tmp_path / "k.pem"
    key.write_text("x")
    assert tls.uvicorn_kwargs(Namespace(ssl_keyfile=None, ssl_certfile=None, ssl_ca_certs=None)) == {}
    with pytest.raises(ValueError, match="go together"):
        tls.check_args(Namespace(ssl_keyfile=str(key), ssl_certfile=None, ssl_ca_certs=None))
    with pytest.raises(ValueError, match="needs --ssl-keyfile"):
        tls.check_args(Namespace(ssl_keyfile=None, ssl_certfile=None, ssl_ca_certs=str(key)))
    with pytest.raises(ValueError, match="--ssl-certfile: no such file"):
        tls.check_args(Namespace(ssl_keyfile=str(key), ssl_certfile=str(tmp_path / "nope"), ssl_ca_certs=None))
    kwargs = tls.uvicorn_kwargs(Namespace(ssl_keyfile=str(key), ssl_certfile=str(key), ssl_ca_certs=str(key)))
    assert kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED and kwargs["ssl_ca_certs"] == str(key)
