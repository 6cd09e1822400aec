"""Prefill / decode disaggregation through the real router and real replicas of the tiny model: the
router prefills on a `--kv-role prefill` replica, whose KV reaches the `--kv-role decode` replica
through the shared tier (a directory on this host, or a real Valkey / Redis server over TCP); the
answer is the one a single replica gives, the decode replica reports the prompt as cached."""

from __future__ import annotations

import json

import httpx
import pytest

from router_processes import RouterProcess
from server_process import side_by_side, start_server, stop_process
from valkey_process import start_valkey, stop_valkey

PROMPT = " ".join(f"word{i} and then some more text number {i}" for i in range(5))  # ~120 tokens of a 256-token context


@pytest.fixture(params=["dir", "url"])
def shared_tier(request, tmp_path):
    if request.param == "dir":
        yield ("--kv-offload-dir", str(tmp_path / "kv"))
        return
    proc, url = start_valkey(tmp_path)
    yield ("--kv-offload-url", url)
    stop_valkey(proc)


@pytest.fixture
def pd(tiny_llama, shared_tier):
    started = side_by_side(lambda: start_server(tiny_llama, "--kv-role", "prefill", *shared_tier),
                           lambda: start_server(tiny_llama, "--kv-role", "decode", *shared_tier),
                           lambda: start_server(tiny_llama))
    (prefill, p_url), (decode, d_url), (single, s_url) = started
    router = None
    try:
        router = RouterProcess([], "--pd-disaggregation", "--prefill", p_url, "--decode", d_url)
        yield router.base, s_url, p_url, d_url
    finally:
        if router is not None:
            router.stop()
        for proc, _ in started:
            stop_process(proc)


def _completion(base: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def _streamed_chat(base: str) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, "temperature": 0,
            "stream": True, "ignore_eos": True}
    text = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def test_a_disaggregated_answer_is_the_single_replicas(pd):
    router, single, prefill_url, decode_url = pd
    answer = _completion(router)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pagoda-prefill-worker"] == prefill_url
    assert answer.headers["x-pagoda-worker"] == decode_url
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prompt came from the prefill
    assert answer.json()["choices"][0]["text"] == _completion(single).json()["choices"][0]["text"]
    assert _streamed_chat(router) == _streamed_chat(single)


def test_without_its_prefill_replica_the_decode_replica_computes_the_prompt(tiny_llama, tmp_path):
    (decode, d_url), (single, s_url) = side_by_side(
        lambda: start_server(tiny_llama, "--kv-role", "decode", "--kv-offload-dir", str(tmp_path / "kv")),
        lambda: start_server(tiny_llama))
    router = RouterProcess([], "--pd-disaggregation", "--prefill", "http://127.0.0.1:9", "--decode", d_url)
    try:
        answer = _completion(router.base)
        assert answer.status_code == 200 and "x-pagoda-prefill-worker" not in answer.headers
        assert answer.json()["choices"][0]["text"] == _completion(s_url).json()["choices"][0]["text"]
    finally:
        router.stop()
        stop_process(decode)
        stop_process(single)
