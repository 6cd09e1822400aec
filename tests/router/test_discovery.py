"""Workers found through DNS (`pagoda router --discover HOST:PORT`, pagoda/router/discovery.py),
as a Kubernetes headless Service gives them: real lookups of names this machine resolves."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import pytest

from pagoda.router.discovery import DnsDiscovery, parse_target, worker_url
from router_processes import RouterProcess


def test_targets_and_urls():
    assert parse_target("pagoda-replicas.default.svc:8000") == ("pagoda-replicas.default.svc", 8000)
    assert parse_target("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_target("pagoda-replicas")
    assert worker_url("10.0.0.7", 8000) == "http://10.0.0.7:8000"
    assert worker_url("fd00::7", 8000) == "http://[fd00::7]:8000"


def test_addresses_that_appear_are_added_and_ones_that_vanish_removed():
    added: list[str] = []
    removed: list[str] = []

    async def add(url: str) -> None:
        added.append(url)

    async def scenario() -> None:
        d = DnsDiscovery(["127.0.0.1:9"], add, removed.append)
        await d.sync()
        await d.sync()  # nothing changed: nothing added twice
        d.targets = [("127.0.0.2", 9)]  # the Service's pod moved
        await d.sync()
        d.targets = [("no-such-host.invalid", 9)]  # a failed lookup keeps the workers as they are
        await d.sync()
        assert d.found == {"http://127.0.0.2:9"}

    asyncio.run(scenario())
    assert added == ["http://127.0.0.1:9", "http://127.0.0.2:9"] and removed == ["http://127.0.0.1:9"]


def test_a_router_with_only_discover_finds_its_replica_and_answers(replicas):
    port = urlsplit(replicas[0]).port
    router = RouterProcess([], "--discover", f"localhost:{port}")
    try:
        workers = router.workers()
        assert f"http://127.0.0.1:{port}" in workers and workers[f"http://127.0.0.1:{port}"]["available"]
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
        answer = httpx.post(f"{router.base}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.headers["x-pagoda-worker"] == f"http://127.0.0.1:{port}"
    finally:
        router.stop()
