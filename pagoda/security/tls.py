"""TLS for `pagoda serve`: HTTPS with --ssl-keyfile / --ssl-certfile, and mutual TLS with
--ssl-ca-certs (every client must then present a certificate signed by one of those CAs; the
handshake fails without one).

    pagoda serve --ssl-keyfile server.key --ssl-certfile server.pem                   # HTTPS
    pagoda serve --ssl-keyfile server.key --ssl-certfile server.pem --ssl-ca-certs ca.pem   # + client certs

uvicorn terminates TLS (its `ssl_*` settings, TLS 1.2 or later); with --grpc-port the gRPC
service takes the same key, certificate and client-certificate rule (`grpc_credentials`).
Import-light: argparse and ssl only.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from pagoda import envs

PASSWORD_ENV = "PAGODA_SSL_KEYFILE_PASSWORD"  # never a command-line option: `ps` would show it


def add_cli_args(p) -> None:
    g = p.add_argument_group("TLS (pagoda/security/tls.py)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help=f"the server's private key (PEM): serve HTTPS (an encrypted key's password: ${PASSWORD_ENV})")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="the server's certificate chain (PEM), with --ssl-keyfile")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates (PEM): require a client certificate signed by one of them (mutual TLS)")


def check_args(ns) -> bool:
    """Whether TLS is on; a ValueError naming the option when the files do not go together or
    cannot be read."""
    key, cert, ca = (getattr(ns, name, None) for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"))
    if not (key or cert or ca):
        return False
    if not (key and cert):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together" if (key or cert)
                         else "--ssl-ca-certs (client certificates) needs --ssl-keyfile and --ssl-certfile")
    for option, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert), ("--ssl-ca-certs", ca)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{option}: no such file: {path}")
    if getattr(ns, "data_parallel_size", 1) not in (None, 1) and getattr(ns, "data_parallel_rank", None) is None:
        raise ValueError("TLS with --data-parallel-size is not supported yet (the router would reach the "
                         "replicas over plain HTTP); put a TLS proxy in front of `pagoda serve -dp N`")
    return True


def uvicorn_kwargs(ns) -> dict:
    """uvicorn.Config's TLS settings for `pagoda serve`'s options (empty without TLS)."""
    if not check_args(ns):
        return {}
    kwargs = {"ssl_keyfile": ns.ssl_keyfile, "ssl_certfile": ns.ssl_certfile,
              "ssl_keyfile_password": envs.PAGODA_SSL_KEYFILE_PASSWORD}
    if ns.ssl_ca_certs:
        kwargs.update(ssl_ca_certs=ns.ssl_ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return kwargs


def grpc_credentials(ns):
    """grpc.ServerCredentials for --grpc-port under the same options (None without TLS)."""
    if not check_args(ns):
        return None
    import grpc  # deferred: grpc loads on first use

    if envs.PAGODA_SSL_KEYFILE_PASSWORD:
        raise ValueError("--grpc-port with TLS needs an unencrypted --ssl-keyfile (gRPC takes no key password)")
    key, cert = Path(ns.ssl_keyfile).read_bytes(), Path(ns.ssl_certfile).read_bytes()
    ca = Path(ns.ssl_ca_certs).read_bytes() if ns.ssl_ca_certs else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
