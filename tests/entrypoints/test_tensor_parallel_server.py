"""`pagoda serve --tensor-parallel-size 2` as an operator runs it: the answers of TP=1, a killed
rank that fails the server cleanly (503, then exit, no process left), SIGTERM that stops every
rank, and a second "node" on 127.0.0.1 (`--nnodes 2 --node-rank 1`) that serves TP=1's tokens."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import httpx
import pytest

from pagoda import LLM, SamplingParams
from pagoda.executor.multiproc import free_port
from server_process import engine_pids, start_server
from test_reliability import Background, _gone, _long, _refused, _stop, metric, wait_for

PROMPTS = ["hello world", "def main():", "the quick brown fox jumps over"]


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[str]:
    """TP=1's greedy completions of PROMPTS."""
    with LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.02) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _completion(base: str, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _worker_pids(server_pid: int) -> list[int]:
    pids = engine_pids(server_pid)  # spawned children: the tensor-parallel ranks
    assert pids, "no worker process found"
    return pids


def test_tp2_server_answers_as_tp1_and_sigterm_stops_every_rank(tiny_llama, expected):
    proc, base = start_server(tiny_llama, "--tensor-parallel-size", "2")
    try:
        workers = _worker_pids(proc.pid)
        assert [_completion(base, p) for p in PROMPTS] == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for pid in workers:
            wait_for(lambda: _gone(pid), timeout=15, what=f"rank process {pid} to exit")
    finally:
        _stop(proc)


@pytest.mark.parametrize("sig,extra,says", [
    (signal.SIGKILL, (), "exited"),  # a dead rank: its sockets close, the monitor sees its exit
    # alive but silent: only the collective timeout can tell
    (signal.SIGSTOP, ("--distributed-timeout-seconds", "3"), "timed out"),
], ids=["killed", "hung"])
def test_a_failed_rank_fails_requests_with_503_and_the_server_exits(long_tiny_llama, sig, extra, says):
    proc, base = start_server(long_tiny_llama, "--tensor-parallel-size", "2", "--kv-cache-memory", "0.05",
                              "--max-model-len", "16384", *extra)
    workers = _worker_pids(proc.pid)
    try:
        request = Background(base, "/v1/completions", _long("p"))
        wait_for(lambda: metric(base, "num_requests_running") == 1, what="the request to run")
        os.kill(workers[0], sig)
        response = request.join(timeout=60).result
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable" and says in error["message"]
        wait_for(lambda: _refused(base), timeout=15, what="the server to refuse")
        assert proc.wait(timeout=30) == 1  # non-zero: a supervisor should restart it
        for pid in workers:  # stopped or not, killed with their parent (PR_SET_PDEATHSIG)
            wait_for(lambda: _gone(pid), timeout=15, what=f"rank process {pid} to exit")
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _stop(proc)


def test_two_nodes_on_localhost_give_tp1_tokens(tiny_llama, expected):
    """torchrun-style flags: node 1 runs rank 1 only (no HTTP), node 0 runs rank 0 and serves."""
    port = str(free_port())
    node1 = subprocess.Popen(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(tiny_llama), "--dtype", "float32",
         "--kv-cache-memory", "0.02", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
         "--master-addr", "127.0.0.1", "--master-port", port],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc, base = start_server(tiny_llama, "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0",
                                  "--master-addr", "127.0.0.1", "--master-port", port)
        try:
            assert [_completion(base, p) for p in PROMPTS] == expected
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            assert node1.wait(timeout=60) == 0  # node 1's ranks stop with the engine
        finally:
            _stop(proc)
    finally:
        _stop(node1)
