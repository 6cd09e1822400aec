"""`pagoda router`'s command line: parsed into the router's config, bad input refused in one line."""

from __future__ import annotations

import subprocess
import sys

from pagoda.entrypoints.cli import build_parser


def test_router_options_parse():
    ns = build_parser().parse_args(["router", "--worker", "http://a:1", "--worker", "http://b:2", "--port", "9000",
                                    "--policy", "least_load", "--qps", "5", "--qps-per-key", "1",
                                    "--max-requests-in-flight", "64", "--admin-key", "k", "--warmup-seconds", "10"])
    assert ns.worker == ["http://a:1", "http://b:2"] and ns.port == 9000 and ns.policy == "least_load"
    assert (ns.qps, ns.qps_per_key, ns.max_requests_in_flight, ns.admin_key, ns.warmup_seconds) == (5, 1, 64, "k", 10)
    assert build_parser().parse_args(["router"]).policy == "cache_aware"


def test_a_bad_worker_url_is_one_clear_line():
    done = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "router", "--worker", "localhost:8000",
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == "pagoda: error: a worker URL must look like http://HOST:PORT, got 'localhost:8000'"
