"""A bounded soak (pagoda.bench.soak) against real servers on 127.0.0.1, the engine on a thread
and in its own process: every answer as expected, the server idle afterwards with no KV block
held, the counters equal to what was sent, and memory not growing with requests served. The
long run (10,000 requests) is benchmarks/soak.py; its figures are in benchmarks/README.md."""

from __future__ import annotations

import pytest

from pagoda.bench.soak import check, soak
from server_process import engine_pids, start_server

REQUESTS = 1200
# RSS may still settle after the warm-up (allocator arenas, caches); a leak of even 10 KiB a
# request would show as 12 MiB here.
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
        growth = report.rss_slope_bytes_per_request() * REQUESTS
        assert growth < MAX_GROWTH_BYTES, report.summary()
        assert report.metrics_after["pagoda:kv_cache_usage_perc"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
