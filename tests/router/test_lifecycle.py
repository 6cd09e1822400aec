"""`pagoda router` as an operator meets it: a worker that never answers is named (in the log, at
start and at each change, and in the 503 a request gets), and a stop signal gives open requests
`--shutdown-timeout` seconds, then ends open streams with an error event and `data: [DONE]` (as
`pagoda serve` does)."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from router_processes import LONG_CONTEXT, RouterProcess, stop, wait_for
from server_process import OpenStream, _free_port, start_server


def test_a_worker_that_never_answers_is_named_in_the_log_and_the_503(long_tiny_llama):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there yet
    router = RouterProcess([url], "--log-level", "info", wait_healthy=False)
    try:
        down = f"worker {url} is down: health probe failed: ConnectError"
        wait_for(lambda: down in router.output(), what="the dead worker in the log")
        answer = httpx.post(f"{router.base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                            timeout=10)
        assert answer.status_code == 503
        assert answer.json()["error"]["message"] == \
            f"no worker is available: {url} (down: health probe failed: ConnectError)"

        # It comes up (logged, and it takes requests), then goes down again (logged).
        replica, _ = start_server(long_tiny_llama, *LONG_CONTEXT, port=int(url.rsplit(":", 1)[1]))
        try:
            wait_for(lambda: f"worker {url} is up" in router.output(), timeout=30, what="the worker up in the log")
            answer = httpx.post(f"{router.base}/v1/completions", timeout=60,
                                json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
        finally:
            stop(replica)
        wait_for(lambda: router.output().count(f"worker {url} is down") == 2, what="the worker down again")
    finally:
        router.stop()


def test_a_stop_signal_drains_for_the_shutdown_timeout_then_ends_requests(replicas):
    """The router waited for its open streams however long they ran (275 s seen); now it gives
    them --shutdown-timeout seconds, says so, and ends them as serve does: a stream with an error
    event and [DONE], a request waiting for its whole answer with 503."""
    router = RouterProcess(replicas, "--shutdown-timeout", "2")
    try:
        stream = OpenStream(router.base)
        plain: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: plain.append(httpx.post(
            f"{router.base}/v1/completions", timeout=120,
            json={"model": "tiny", "prompt": "hi", "max_tokens": 15000, "ignore_eos": True})))
        waiting.start()
        stream.wait_started()
        wait_for(lambda: _in_flight(router) == 2, what="both requests to be in flight")
        router.proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        wait_for(lambda: "SIGINT: shutting down; 2 request(s) in flight get up to 2s to finish" in router.output(),
                 what="the drain in the log")
        stream.join(timeout=30)
        assert stream.error_code() == "shutting_down", (stream.error, stream.events[-2:])
        assert stream.ended_at is not None and stream.ended_at - signalled > 1.5  # it had its drain time
        waiting.join(timeout=30)
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "shutting_down"
        assert router.proc.wait(timeout=30) == 0, router.output()
    finally:
        router.stop()


def _in_flight(router: RouterProcess) -> int:
    return sum(w["in_flight"] for w in router.workers().values())
