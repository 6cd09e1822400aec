"""pagoda on a real local Ray cluster through Ray Serve (pagoda/ray_serve/app.py), driven by the
openai client through Serve's HTTP proxy: greedy answers equal the offline LLM's; under load the
engine deployment scales 1 -> 2 replicas, a session stays on one replica while both run and a
prompt that extends another goes where that one went; idle, it scales back to 1; a replica
killed while it holds a request that has sent nothing yet is replaced, and the request is
retried and answered. The scale-up and scale-down times are printed (benchmarks/README.md)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import ray
from ray import serve

from pagoda import LLM, SamplingParams
from pagoda.executor.multiproc import free_port
from pagoda.ray_serve import build_app
from pagoda.ray_serve.app import APP_NAME, serve_on
from pagoda.ray_serve.autoscaling import ScalingOptions
from pagoda.ray_serve.engine_replica import ServerOptions
from tests.ray_serve.conftest import ENGINE, poll, running_replicas

PROMPTS = ["hello world", "The quick brown fox", "Paris is the capital of"]
MODEL = "tiny"
SCALING = ScalingOptions(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=1,
                         downscale_delay_s=4, look_back_period_s=2)



@pytest.fixture(scope="module")
def base(ray_cluster, long_tiny_llama) -> str:
    port = free_port()
    serve_on(build_app(str(long_tiny_llama), scaling=SCALING, server=ServerOptions([MODEL]), replica_cpus=0.5, max_ongoing_requests=8, **ENGINE),
             "127.0.0.1", port)
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def _replica_of(base: str, prompt: str, session: str | None = None) -> str:
    headers = {"X-Session-ID": session} if session else {}
    r = httpx.post(f"{base}/v1/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.headers["x-pagoda-replica"]


def test_greedy_answers_equal_the_offline_llm(client, long_tiny_llama):
    expected = [o.outputs[0].text for o in LLM(str(long_tiny_llama), **ENGINE).generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)]
    model = client.models.list().data[0].id
    assert model == MODEL
    got = [client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == expected
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True))
    assert streamed == expected[0]


class Load:
    """`clients` threads, each sending completions one after another until stopped; distinct
    prompts, so the cache-aware policy spreads them by load."""

    def __init__(self, base: str, clients: int) -> None:
        self.base, self.stop, self.errors = base, threading.Event(), []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            r = httpx.post(f"{self.base}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": f"{i}-{n} load", "max_tokens": 64, "ignore_eos": True, "temperature": 0})
            if r.status_code != 200:
                self.errors.append(r.text)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def _routed_to_both(base: str) -> bool:
    return len({_replica_of(base, "probe", f"probe-{i}") for i in range(8)}) == 2


def test_scales_up_under_load_keeps_affinity_and_scales_down_idle(base):
    poll(lambda: running_replicas() == 1, 60, "one replica at rest")
    with Load(base, clients=4) as load:
        start = time.monotonic()
        poll(lambda: running_replicas() == 2, 120, "a second replica under load")
        scale_up_s = time.monotonic() - start
        # the controller counts the new replica running a moment before the ingress's request
        # router hears of it; until then every session goes to the first one
        poll(lambda: _routed_to_both(base), 60, "the ingress routing to both replicas")
        # both replicas up (the load keeps them): each session stays on one replica
        sessions = {f"s{i}": {_replica_of(base, f"turn {t} of session {i}", f"s{i}") for t in range(2)}
                    for i in range(16)}
        assert all(len(replicas) == 1 for replicas in sessions.values()), sessions
        assert len(set().union(*sessions.values())) == 2  # and the sessions spread over both
        # no session key: a prompt that extends another goes to where that one went (prefix cache)
        stem = "a long shared system prompt for the prefix-aware policy " * 4
        assert _replica_of(base, stem + "first question") == _replica_of(base, stem + "second question")
    assert not load.errors, load.errors[:3]
    stop = time.monotonic()
    poll(lambda: running_replicas() == 1, 120, "back to one replica when idle")
    scale_down_s = time.monotonic() - stop
    print(f"\nray serve scaling: 1 -> 2 replicas {scale_up_s:.1f}s after the load began (upscale_delay_s="
          f"{SCALING.upscale_delay_s}); 2 -> 1 {scale_down_s:.1f}s after it ended (downscale_delay_s="
          f"{SCALING.downscale_delay_s})")


def _running_requests(base: str) -> float:
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    line = next(l for l in metrics.splitlines() if l.startswith("pagoda:num_requests_running"))
    return float(line.split()[-1])


def test_a_killed_replica_is_replaced_and_its_request_retried(base, client, long_tiny_llama):
    poll(lambda: running_replicas() == 1, 120, "one replica")
    prompt, tokens = "a request long enough to be killed in flight", 1500
    expected = LLM(str(long_tiny_llama), **ENGINE).generate(
        [prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    killed = []
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.completions.with_raw_response.create, model=MODEL, prompt=prompt,
                             max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})
        poll(lambda: _running_requests(base) >= 1, 30, "the request in flight")
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if "pagoda-engine" in actor["name"]:  # the replica holding it, and any other
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
                killed.append(actor["name"])
        raw = answer.result(timeout=180)
    assert killed and not any(name.endswith(raw.headers["x-pagoda-replica"]) for name in killed)  # answered by another
    assert raw.parse().choices[0].text == expected.outputs[0].text
    poll(lambda: running_replicas() == 1, 120, "the replica replaced")


def test_tensor_parallel_replica_matches_one_rank(base, long_tiny_llama):
    """A replica of tensor_parallel_size=2: its placement group holds a bundle per rank, rank 1 an
    actor in the second (pagoda/executor/ray.py); greedy answers equal one rank's, offline."""
    serve.delete(APP_NAME)  # the cluster's 2 CPUs: the autoscaled app makes room (Serve's proxy stays)
    port = int(base.rsplit(":", 1)[1])
    serve_on(build_app(str(long_tiny_llama), server=ServerOptions([MODEL]), replica_cpus=0.5, tensor_parallel_size=2,
                       **ENGINE), "127.0.0.1", port)
    expected = [o.outputs[0].text for o in LLM(str(long_tiny_llama), **ENGINE).generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)]
    tp_client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    got = [tp_client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == expected
    # one placement group, the replica's (a bundle a rank): the ranks did not reserve one of their own
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert [len(g["bundles"]) for g in groups] == [2], groups
