"""SIGKILL of a replica behind the router, under load: no non-streaming request is lost, a stream
that was on it ends with an error event, the dead replica shows unhealthy, and once restarted
it rejoins (warming up) and gets its sessions back."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from router_processes import LONG_CONTEXT, RouterProcess, start_replicas, stop, wait_for
from server_process import start_server
from pagoda.router.proxy import WORKER_HEADER

MODEL = "tiny"
SESSIONS = [f"session-{i}" for i in range(24)]


@pytest.fixture
def cluster(long_tiny_llama):
    """Two replicas of their own (one will be killed) and a router with fast probes and a short
    warm-up."""
    started = start_replicas(long_tiny_llama, 2, *LONG_CONTEXT)
    procs = {base: proc for proc, base in started}
    router = RouterProcess(list(procs), "--warmup-seconds", "2", "--breaker-open-seconds", "1")
    yield router, procs
    router.stop()
    for proc in procs.values():
        stop(proc)


def _owner(router: RouterProcess, session: str) -> str:
    answer = httpx.post(f"{router.base}/v1/completions", headers={"X-Session-ID": session}, timeout=60,
                        json={"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return answer.headers[WORKER_HEADER]


def _load(router: RouterProcess, stop_event: threading.Event, results: list[int], worker_id: int) -> None:
    """Non-streaming requests, one after another, until told to stop."""
    i = 0
    with httpx.Client(timeout=60) as client:
        while not stop_event.is_set():
            answer = client.post(f"{router.base}/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 16, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"load {worker_id}-{i}"}]})
            results.append(answer.status_code)
            i += 1


def test_sigkill_of_a_replica_under_load(cluster, long_tiny_llama):
    router, procs = cluster
    owners = {s: _owner(router, s) for s in SESSIONS}
    assert set(owners.values()) == set(procs)

    body = {"model": MODEL, "max_tokens": 8000, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "a long story"}]}
    with httpx.stream("POST", f"{router.base}/v1/chat/completions", json=body, timeout=60) as stream:
        victim = stream.headers[WORKER_HEADER]
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # the stream is running on the victim

        stop_event, results = threading.Event(), []
        threads = [threading.Thread(target=_load, args=(router, stop_event, results, n)) for n in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: len(results) >= 6, what="load to flow")
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
        rest = [line for line in lines if line.startswith("data: ")]
        count_at_kill = len(results)
        wait_for(lambda: len(results) >= count_at_kill + 12, what="load after the kill")
        stop_event.set()
        for t in threads:
            t.join()

    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and error["code"] == "worker_failed"
    assert results and set(results) == {200}, results  # no non-streaming request lost
    dead = router.workers()[victim]
    assert dead["healthy"] is False and dead["available"] is False
    survivor = next(url for url in procs if url != victim)
    assert all(_owner(router, s) == survivor for s in SESSIONS)  # the ring healed around it

    port = int(victim.rsplit(":", 1)[1])
    procs[victim], _ = start_server(long_tiny_llama, *LONG_CONTEXT, port=port)  # restarted where it was
    rejoined = wait_for(lambda: (w := router.workers()[victim])["available"] and w, what="the replica to rejoin")
    assert rejoined["weight"] < 1  # warming up, not its full share at once
    wait_for(lambda: router.workers()[victim]["weight"] == 1.0, what="the warm-up to finish")
    assert {s: _owner(router, s) for s in SESSIONS} == owners  # its sessions came back
