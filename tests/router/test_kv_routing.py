"""Exact prefix routing on the workers' KV events (pagoda/router/kv_routing.py): two real replicas
publish their prefix caches' events (`--kv-events-config`), a real `pagoda router --kv-events
... --tokenizer` subscribes. A prompt computed on one replica behind the router's back (sent to it
directly, so the router's own prefix tree never saw it) is known to the router only through that
replica's events; a prompt that extends it must then go to that replica, for a completion and
for a chat (the chat template rendered at the router as the replica renders it)."""

from __future__ import annotations

import time

import httpx
import pytest

from router_processes import LONG_CONTEXT, RouterProcess, start_replicas, stop
from server_process import _free_port

from pagoda.router.kv_events_subscriber import KVEventsSubscriber
from pagoda.router.kv_index import KVBlockIndex
from pagoda.router.kv_routing import KVRouting
from pagoda.router.options import parse_endpoints

MODEL = "tiny"
DOCUMENT = " ".join(f"Clause {i} of a long shared document that several requests start with." for i in range(24))


@pytest.fixture(scope="module")
def publishing(long_tiny_llama):
    """Two replicas, each publishing its KV events on a port of its own: [(base URL, port)]."""
    ports = [_free_port(), _free_port()]
    started = []
    try:
        for port in ports:
            config = f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}"}}'
            started += start_replicas(long_tiny_llama, 1, *LONG_CONTEXT, "--kv-events-config", config)
        yield [(base, port) for (_, base), port in zip(started, ports)]
    finally:
        for proc, _ in started:
            stop(proc)


@pytest.fixture(scope="module")
def router(publishing, long_tiny_llama):
    r = RouterProcess([base for base, _ in publishing], "--tokenizer", str(long_tiny_llama),
                      *[arg for base, port in publishing for arg in ("--kv-events", f"{base}=tcp://127.0.0.1:{port}")])
    yield r
    r.stop()


def _metric(router: RouterProcess, name: str, label: str = "") -> float:
    text = httpx.get(f"{router.base}/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and label in line and not line.startswith("#")]
    return sum(values)


def _wait_for_blocks(router: RouterProcess, worker: str, more_than: float) -> None:
    """Until the router's index holds more of `worker`'s blocks than before (the events arrived)."""
    deadline = time.monotonic() + 30
    while _metric(router, "pagoda_router:kv_index_blocks", f'worker="{worker}"') <= more_than:
        assert time.monotonic() < deadline, router.output()[-3000:]
        time.sleep(0.1)  # polling the router's metrics, not waiting for correctness


@pytest.mark.parametrize("path, first, then", [
    ("/v1/completions", {"prompt": DOCUMENT}, {"prompt": DOCUMENT + " And now a question about it?"}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Hi"}]},
     {"messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Another question"}]}),
])
def test_a_prompt_goes_where_its_prefix_was_computed(router, publishing, path, first, then):
    for holder, _ in publishing:  # each replica in turn: the choice is no coin toss
        salt = f"[{holder}] "  # a prefix neither replica has computed yet
        first_body, then_body = _salted(first, salt), _salted(then, salt)
        before = _metric(router, "pagoda_router:kv_index_blocks", f'worker="{holder}"')
        direct = httpx.post(holder + path, json={"model": MODEL, "max_tokens": 1, **first_body}, timeout=60)
        assert direct.status_code == 200, direct.text
        _wait_for_blocks(router, holder, before)
        decisions = _metric(router, "pagoda_router:routing_decisions_total", 'reason="kv_prefix"')
        routed = httpx.post(router.base + path, json={"model": MODEL, "max_tokens": 1, **then_body}, timeout=60)
        assert routed.status_code == 200, routed.text
        assert routed.headers["x-pagoda-worker"] == holder
        assert _metric(router, "pagoda_router:routing_decisions_total", 'reason="kv_prefix"') == decisions + 1


def _salted(body: dict, salt: str) -> dict:
    if "prompt" in body:
        return {"prompt": salt + body["prompt"]}
    system, *rest = body["messages"]
    return {"messages": [{**system, "content": salt + system["content"]}, *rest]}


def test_a_worker_publishes_where_the_flags_say():
    """--kv-events names a worker's endpoint; --kv-events-port gives every other one its own host's."""
    named = {"http://10.0.0.5:8000": "tcp://10.0.0.9:6000"}
    subscriber = KVEventsSubscriber(KVBlockIndex(), named, 5557)
    assert subscriber.endpoint_of("http://10.0.0.5:8000") == "tcp://10.0.0.9:6000"
    assert subscriber.endpoint_of("http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert KVEventsSubscriber(KVBlockIndex(), named, None).endpoint_of("http://10.0.0.7:8000") is None
    assert parse_endpoints(["http://a:1/=tcp://a:2"]) == {"http://a:1": "tcp://a:2"}
    with pytest.raises(ValueError, match="WORKER_URL=tcp://HOST:PORT"):
        parse_endpoints(["tcp://a:2"])


def test_the_flags_name_what_is_missing(long_tiny_llama):
    with pytest.raises(ValueError, match="--tokenizer"):
        KVRouting.of({}, 5557, None)
    with pytest.raises(ValueError, match="--kv-events"):
        KVRouting.of({}, None, str(long_tiny_llama))
    assert KVRouting.of({}, None, None) is None
