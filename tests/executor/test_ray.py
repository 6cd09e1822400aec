"""--distributed-executor-backend ray on a real local Ray cluster (one head with 2 CPUs, for the
module): TP=2 with rank 1 in a Ray actor gives TP=1's tokens and logprobs; a dead actor fails the
engine even while it idles; shutdown leaves nothing in the cluster; without a cluster the engine
says how to start one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray  # in the test extra: this module runs, it does not skip
import torch

from pagoda import LLM, SamplingParams
from pagoda.executor.base import WorkerFailedError
from pagoda.executor.multiproc import free_port

CLUSTER_CPUS = 2
PROMPTS = ["hello world", "The quick brown fox", "Paris is the capital of", "def main():"]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
ENGINE = {"dtype": "float32", "kv_cache_memory": 0.01}


def _ray_cli(*args: str) -> None:
    subprocess.run([str(Path(sys.executable).with_name("ray")), *args], check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray head, named to the engine by RAY_ADDRESS."""
    port = free_port()
    _ray_cli("start", "--head", f"--port={port}", f"--num-cpus={CLUSTER_CPUS}", "--include-dashboard=false",
             "--disable-usage-stats")
    address = f"127.0.0.1:{port}"
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RAY_ADDRESS", address)
            yield address
    finally:
        ray.shutdown()  # before the cluster goes: a connected process would wait for it
        _ray_cli("stop", "--force")


@contextlib.contextmanager
def _ray_llm(path: Path):
    """A TP=2 LLM on the cluster, shut down after the block (this process's torch threads as they were)."""
    threads = torch.get_num_threads()
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        yield llm
    finally:
        llm.engine.core.shutdown()
        torch.set_num_threads(threads)  # the executor gave rank 0 its share of the cores
    assert not ray.is_initialized()  # the executor connected this process, and disconnected it


def _generate(llm: LLM) -> list:
    return [out.outputs[0] for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _free_cpus(address: str, wait_s: float = 10.0) -> float:
    """The cluster's free CPUs once every CPU is back or ``wait_s`` passed (kills are asynchronous)."""
    ray.init(address=address)
    try:
        deadline = time.monotonic() + wait_s
        while ray.available_resources().get("CPU", 0) < CLUSTER_CPUS and time.monotonic() < deadline:
            time.sleep(0.2)
        return ray.available_resources().get("CPU", 0)
    finally:
        ray.shutdown()


def test_tp2_on_ray_matches_tp1_and_frees_the_cluster(ray_cluster, tiny_llama):
    reference = _generate(LLM(str(tiny_llama), **ENGINE))
    with _ray_llm(tiny_llama) as llm:
        got = _generate(llm)
        ranks = llm.engine.core.executor.collective_rpc("memory_report")
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]  # rank 1: an actor
    for ref, out in zip(reference, got, strict=True):
        assert out.token_ids == ref.token_ids
        for ref_pos, pos in zip(ref.logprobs, out.logprobs, strict=True):
            assert pos.keys() == ref_pos.keys()
            for token, lp in pos.items():
                assert lp.logprob == pytest.approx(ref_pos[token].logprob, abs=1e-5)
    assert _free_cpus(ray_cluster) == CLUSTER_CPUS  # no actor, no placement group left


def test_a_dead_actor_fails_the_engine_while_it_idles(ray_cluster, tiny_llama):
    with _ray_llm(tiny_llama) as llm:
        executor = llm.engine.core.executor
        ray.kill(executor.actors[0])
        deadline = time.monotonic() + 10
        with pytest.raises(WorkerFailedError, match="rank 1 stopped"):
            while time.monotonic() < deadline:
                executor.check_health()
                time.sleep(0.1)
        with pytest.raises(WorkerFailedError):
            _generate(llm)
    assert _free_cpus(ray_cluster) == CLUSTER_CPUS


def test_without_a_cluster_the_error_says_how_to_start_one(tiny_llama, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(ValueError, match="ray start"):
        LLM(str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
