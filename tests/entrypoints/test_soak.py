"""A bounded soak (pagoda.bench.soak) against real servers on 127.0.0.1, the engine on a thread
and in its own process: every answer as expected, the server idle afterwards with no KV block
held, the counters equal to what was sent, and memory not growing with requests served. The
long run (10,000 requests) is benchmarks/soak.py; its figures are in benchmarks/README.md."""

from __future__ import annotations

import pytest

from pagoda.bench.soak import check, soak
from server_process import engine_pids, start_server

REQUESTS = 1200
# A leak of 20 KiB a request (23 MiB over the run, on top of the few MiB RSS drifts anyway) fails
# the bound. The slope of RSS against requests served leaves out what grows without leaking: the
# first 20 % of the run (allocator arenas, caches, the first grammar compiled) and the KV cache's
# pages, which the kernel hands out as its blocks are first used (its 20 MiB over the first ~750
# requests, whatever the load: pagoda/bench/soak.py, kv_cache_rss_bytes).
MAX_GROWTH_BYTES = 24 * 2**20


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_soak(tiny_llama, engine_process):
    proc, base = start_server(tiny_llama, *(["--engine-process"] if engine_process else []))
    try:
        pids = [proc.pid, *engine_pids(proc.pid)]
        assert len(pids) == (2 if engine_process else 1)
        report = soak(base, REQUESTS, concurrency=16, seed=1, pids=pids)
        assert check(report) == []
        assert report.dropped > 0 and report.statuses[400] > 0 and report.statuses[200] > 0
        assert report.delta("pagoda:request_success_total:abort") > 0
        assert report.kv_cache_samples[-1] > 0  # the KV cache's pages are found, and left out
        growth = report.rss_slope_bytes_per_request() * REQUESTS
        assert growth < MAX_GROWTH_BYTES, report.summary()
        assert report.metrics_after["pagoda:kv_cache_usage_perc"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
