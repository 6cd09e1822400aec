"""`pagoda serve` as a real subprocess on 127.0.0.1, driven with the openai SDK and httpx."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from server_process import child_pids, start_server

MODEL = "tiny"


_start = functools.partial(start_server, name=MODEL)


@pytest.fixture(scope="module")
def server(tiny_llama):
    proc, base = _start(tiny_llama)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)


def test_models_route(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 256 and raw["root"]


def test_completion_equals_offline_greedy(client, offline):
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    expected = offline.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids) and out.usage.completion_tokens == 12


def test_prompt_forms(client, offline):
    ids = offline.get_tokenizer().encode("Hello Paris")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="Hello Paris", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["Hello Paris", "Once upon"], max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == by_text.choices[0].text
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in many_ids.choices] == [by_text.choices[0].text] * 2


def _stream_chat(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    return chunks


def test_chat_streaming_invariants(client):
    messages = [{"role": "user", "content": "Tell me about Paris"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = _stream_chat(client, messages=messages, max_tokens=20, temperature=0, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["length"]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert full.usage.completion_tokens == 20


def test_cached_tokens_reported_in_usage(client):
    messages = [{"role": "system", "content": "Paris is the capital of France. " * 12}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    salted = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                            extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_sse_ends_with_done(server):
    with httpx.stream("POST", f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_n_and_seed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0).choices[0].text
    stop = full[5:7]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_logprobs_and_echo(client, offline):
    out = client.completions.create(model=MODEL, prompt="Hello Paris", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    # Keys are decoded strings (OpenAI's format): alternatives that decode alike collapse into one.
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert all(max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    echoed = client.completions.create(model=MODEL, prompt="Hello Paris", max_tokens=5, temperature=0, logprobs=1, echo=True)
    n_prompt = len(offline.get_tokenizer().encode("Hello Paris"))
    assert echoed.choices[0].text.startswith("Hello Paris")
    assert len(echoed.choices[0].logprobs.tokens) == n_prompt + 5
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    assert all(v is not None for v in echoed.choices[0].logprobs.token_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == c.logprob for c in content)  # greedy picks the top token


@pytest.mark.parametrize("body,param", [
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "top_p": 2}, "top_p"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "Hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"max_tokens": 3}, "prompt"),
])
def test_bad_parameters_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_context_overflow_and_unknown_model(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 1000})
    assert r.status_code == 400 and "256" in r.json()["error"]["message"] and "1000" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", json={"model": "nope", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # still serving
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_tokenize_detokenize_version(server, offline):
    r = httpx.post(f"{server}/tokenize", json={"prompt": "Hello Paris"}).json()
    assert r["tokens"] == offline.get_tokenizer().encode("Hello Paris")
    assert httpx.post(f"{server}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello Paris"
    assert httpx.get(f"{server}/version").json()["version"]


def test_sixty_four_concurrent_streams_complete(server):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Request {i}"}], max_tokens=16, temperature=0, stream=True)
        finishes, text = [], ""
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                if ch.finish_reason:
                    finishes.append(ch.finish_reason)
        return finishes, text

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(len(f) == 1 and f[0] in ("stop", "length") for f, _ in results)  # exactly one finish each


def test_api_key_required_when_set(tiny_llama):
    proc, base = _start(tiny_llama, "--api-key", "sekret")
    try:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        ok = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret").completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                                              extra_body={"ignore_eos": True})
        assert ok.choices[0].finish_reason == "length"
        assert httpx.get(f"{base}/health").status_code == 200  # health stays open
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def test_metrics_after_requests(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    text = httpx.get(f"{server}/metrics").text
    for name in ["pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc",
                 "pagoda:prompt_tokens_total", "pagoda:generation_tokens_total", "pagoda:time_to_first_token_seconds_bucket",
                 "pagoda:inter_token_latency_seconds_bucket", "pagoda:e2e_request_latency_seconds_bucket",
                 "pagoda:num_preemptions_total", "pagoda:request_queue_time_seconds_bucket"]:
        assert name in text, name
    assert _metric(server, "pagoda:generation_tokens_total") >= 4
    assert _metric(server, "pagoda:request_queue_time_seconds_count") >= 1


def test_metrics_under_vllms_names_for_its_ecosystem(server, client):
    """llm-d's endpoint picker, the Gateway API Inference Extension and KServe read vLLM's names:
    each is there, with the same value and labels as pagoda's own, in valid Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)
               for s in family.samples}
    pairs = [("num_requests_running", "num_requests_running"), ("num_requests_waiting", "num_requests_waiting"),
             ("kv_cache_usage_perc", "kv_cache_usage_perc"), ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
             ("prefix_cache_queries_total", "prefix_cache_queries_total"),
             ("prefix_cache_hits_total", "prefix_cache_hits_total"), ("prompt_tokens_total", "prompt_tokens_total"),
             ("generation_tokens_total", "generation_tokens_total"),
             ("time_to_first_token_seconds_count", "time_to_first_token_seconds_count"),
             ("inter_token_latency_seconds_count", "time_per_output_token_seconds_count"),
             ("e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_bucket")]
    for ours, theirs in pairs:
        mine = {labels: v for (name, labels), v in samples.items() if name == f"pagoda:{ours}"}
        copied = {labels: v for (name, labels), v in samples.items() if name == f"vllm:{theirs}"}
        assert mine and copied == mine, (ours, theirs)
        assert all(("model_name", MODEL) in labels for labels in copied)
    assert samples[("vllm:generation_tokens_total", (("model_name", MODEL),))] >= 4


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break  # leave mid-stream: the connection closes here
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _metric(server, "pagoda:num_requests_running") == 0 and _metric(server, "pagoda:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.2)
    assert _metric(server, "pagoda:num_requests_running") == 0
    assert _metric(server, "pagoda:kv_cache_usage_perc") == 0
    # Nothing still generates: a request run to its end afterwards takes engine steps, and the
    # tokens generated meanwhile are exactly its own.
    total_generated_before = _metric(server, "pagoda:generation_tokens_total")
    after = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "ignore_eos": True,
                                                          "temperature": 0}, timeout=60).json()
    assert after["usage"]["completion_tokens"] == 8
    assert _metric(server, "pagoda:generation_tokens_total") == total_generated_before + 8


def test_queue_limit_gives_429_with_retry_after(long_tiny_llama):
    # room for two: one running (--max-num-seqs 1), one waiting (--max-queue-len 1)
    proc, base = _start(long_tiny_llama, "--max-num-seqs", "1", "--max-queue-len", "1", "--max-model-len", "16384",
                        "--kv-cache-memory", "0.05")
    try:
        def in_flight() -> float:
            lines = httpx.get(f"{base}/metrics").text.splitlines()
            return sum(float(x.rsplit(" ", 1)[1]) for x in lines
                       if x.startswith(("pagoda:num_requests_running{", "pagoda:num_requests_waiting{")))

        async def run():
            async with httpx.AsyncClient(base_url=base, timeout=120) as c:
                long = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
                first = [asyncio.create_task(c.post("/v1/completions", json=long)) for _ in range(2)]
                deadline = time.monotonic() + 60
                while in_flight() < 2 and time.monotonic() < deadline:  # both queued or running
                    await asyncio.sleep(0.02)
                third = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                done = await asyncio.gather(*first)
                after = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                return third, done, after
        third, done, after = asyncio.run(run())
        assert third.status_code == 429 and third.headers["retry-after"]
        assert third.json()["error"]["type"] == "rate_limit_error"
        assert [r.status_code for r in done] == [200, 200]
        assert after.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# Runs the real server with EngineCore.step failing once a request with a marker prompt arrives.
_FAULTY_SERVER = """
import sys
from pagoda.engine.core import EngineCore
real_step = EngineCore.step
def step(self):
    if any(r.prompt_token_ids[:3] == [300, 301, 302] for r in self.scheduler.requests.values()):
        raise RuntimeError("injected engine failure")
    return real_step(self)
EngineCore.step = step
from pagoda.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_failure_fails_requests_and_health_without_hanging(tiny_llama):
    proc, base = _start(tiny_llama, launcher=["-c", _FAULTY_SERVER])
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
            failed = c.post("/v1/completions", json={"prompt": [300, 301, 302], "max_tokens": 3})
            assert failed.status_code in (500, 503)
            assert "injected engine failure" in failed.json()["error"]["message"]
            assert c.get("/health").status_code == 503
            after = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert after.status_code == 503 and after.json()["error"]["type"] == "server_error"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_smollm2_end_to_end(smollm2_gguf):
    """The default model through the server answers as the offline engine does (greedy, fp32)."""
    proc, base = _start("smollm2", "--kv-cache-memory", "0.25", name="smollm2-135m-instruct")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        question = [{"role": "user", "content": "What is the capital of France?"}]
        out = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, max_tokens=24, temperature=0)
        streamed = "".join(ch.delta.content or "" for c in client.chat.completions.create(
            model="smollm2-135m-instruct", messages=question, max_tokens=24, temperature=0, stream=True) for ch in c.choices)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    offline = LLM(model="smollm2", dtype="float32", kv_cache_memory=0.25)
    expected = offline.chat(question, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert out.choices[0].message.content == expected.text == streamed
    assert "Paris" in expected.text and out.choices[0].finish_reason == expected.finish_reason


def test_engine_in_its_own_process(tiny_llama, offline):
    """--engine-process: the same answers, streaming, and aborts that free blocks."""
    proc, base = _start(tiny_llama, "--engine-process")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
        expected = offline.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        assert out.choices[0].text == expected.outputs[0].text
        seeded = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0, seed=11)
        assert client.completions.create(**seeded).choices[0].text == client.completions.create(**seeded).choices[0].text
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, stream=True) if c.choices)
        assert text == expected.outputs[0].text
        # A constrained request: its grammar is compiled in the engine process.
        regex = client.completions.create(model=MODEL, prompt="hi", max_tokens=20, extra_body={"guided_regex": "[0-9]{5}"})
        assert regex.choices[0].text.isdigit() and len(regex.choices[0].text) == 5
        test_disconnect_mid_stream_aborts_and_frees_blocks(base)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_engine_process_exits_when_the_server_is_killed(tiny_llama):
    proc, _ = _start(tiny_llama, "--engine-process")
    engines = child_pids(proc.pid)
    assert engines, "the server should have an engine process"
    proc.kill()  # SIGKILL: no shutdown code runs in the server
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in engines):
        time.sleep(0.2)
    alive = [pid for pid in engines if Path(f"/proc/{pid}/stat").exists()
             and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"engine process(es) {alive} outlived the server"
