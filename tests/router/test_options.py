"""`pagoda router`'s command line: parsed into the router's config, bad input refused in one line."""

from __future__ import annotations

import socket
import subprocess
import sys

from pagoda.cli import build_parser


def test_router_options_parse():
    ns = build_parser().parse_args(["router", "--worker", "http://a:1", "--worker", "http://b:2", "--port", "9000",
                                    "--policy", "least_load", "--qps", "5", "--qps-per-key", "1",
                                    "--max-requests-in-flight", "64", "--admin-key", "k", "--warmup-seconds", "10"])
    assert ns.worker == ["http://a:1", "http://b:2"] and ns.port == 9000 and ns.policy == "least_load"
    assert (ns.qps, ns.qps_per_key, ns.max_requests_in_flight, ns.admin_key, ns.warmup_seconds) == (5, 1, 64, "k", 10)
    assert build_parser().parse_args(["router"]).policy == "cache_aware"


def test_a_bad_worker_url_is_one_clear_line():
    done = subprocess.run([sys.executable, "-m", "pagoda.cli", "router", "--worker", "localhost:8000",
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == "pagoda: error: a worker URL must look like http://HOST:PORT, got 'localhost:8000'"


def _pagoda(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagoda.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_a_busy_port_fails_before_the_banner_as_serve_does():
    """The router printed its "router ... on http://..." banner, then uvicorn's bind error, and
    exited 3; it binds first now (serve's bind_listener), so it fails with one line and 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _pagoda("router", "--worker", "http://127.0.0.1:9", "--port", str(port))
    assert done.returncode == 1
    assert done.stdout == ""  # no banner
    assert done.stderr.strip() == (f"pagoda: error: cannot listen on 127.0.0.1:{port}: Address already in use (is "
                                   "another server running there? choose another --port)")


def test_an_empty_admin_key_is_refused():
    """`--admin-key "$KEY"` with KEY unset was taken silently, and the admin routes stayed off."""
    done = _pagoda("router", "--worker", "http://127.0.0.1:9", "--port", "0", "--admin-key", "")
    assert done.returncode == 1
    assert done.stderr.strip() == ("pagoda: error: --admin-key is empty (an unset variable?): give the key, or leave "
                                   "--admin-key out to keep the admin routes off")
    # --data-parallel-size's router too, before any replica starts
    done = _pagoda("serve", "--model", "unused", "--data-parallel-size", "2", "--router-admin-key", " ")
    assert done.returncode == 1 and "--router-admin-key is empty (an unset variable?)" in done.stderr
