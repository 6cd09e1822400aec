"""`pagoda serve --data-parallel-size 2`: two replicas of the tiny model behind the router in one
command. Requests work and reach both replicas, each replica runs on its own share of the cores,
`/workers` lists both; a replica that is killed is started again and rejoins warming up; Ctrl-C
stops everything (a stream still open ends with an error event and [DONE]) and exits 0."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from router_processes import LONG_CONTEXT, DataParallelServe, wait_for
from server_process import OpenStream, child_pids

from pagoda.router.proxy import WORKER_HEADER


def _cores(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def data_parallel(long_tiny_llama):
    serve = DataParallelServe(long_tiny_llama, 2, "--router-policy", "round_robin", "--router-warmup-seconds", "60",
                              "--shutdown-timeout", "2", *LONG_CONTEXT)
    yield serve
    serve.stop()


def _complete(base: str, i: int) -> httpx.Response:
    answer = httpx.post(f"{base}/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    return answer


def test_data_parallel_serve(data_parallel):
    proc, base = data_parallel.proc, data_parallel.base
    _workers = data_parallel.workers
    workers = _workers()
    assert len(workers) == 2 and all(w["healthy"] for w in workers.values())

    seen = [_complete(base, i).headers[WORKER_HEADER] for i in range(6)]
    assert set(seen) == set(workers)  # round_robin: both replicas get traffic
    assert all(w["requests"] >= 3 for w in _workers().values())

    replicas = child_pids(proc.pid)
    assert len(replicas) == 2
    if len(os.sched_getaffinity(0)) >= 2:  # each replica pinned to its own share of the cores
        assert _cores(replicas[0]) != _cores(replicas[1])

    # A replica that dies is started again on its port and rejoins, warming up.
    victim = replicas[0]
    os.kill(victim, signal.SIGKILL)
    new = wait_for(lambda: [p for p in child_pids(proc.pid) if p not in replicas], timeout=30,
                   what="the replica to be restarted")
    assert len(new) == 1
    rejoined = wait_for(lambda: [w for w in _workers().values() if w["healthy"] and w["weight"] < 1],
                        timeout=120, interval=0.2, what="the restarted replica to rejoin warming up")
    assert len(rejoined) == 1
    for i in range(4):
        _complete(base, i)

    # Ctrl-C stops the router and every replica; the command exits 0. A stream still open after
    # --shutdown-timeout ends with an error event and [DONE] (it used to be cut: no event, no [DONE]).
    survivors = [replicas[1], new[0]]
    stream = OpenStream(base)
    stream.wait_started()
    proc.send_signal(signal.SIGINT)
    assert stream.join().error_code() == "shutting_down", (stream.error, stream.events[-2:])
    assert proc.wait(timeout=90) == 0, data_parallel.output()
    wait_for(lambda: not any(_alive(p) for p in survivors), timeout=10, what="the replicas to exit")
