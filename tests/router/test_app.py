"""The router in front of two real `pagoda serve` replicas of the tiny model: affinity, streaming
pass-through, the openai SDK, cache-aware routing, admin routes, metrics and gateway limits."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import openai
import pytest

from router_processes import ADMIN_KEY, RouterProcess, wait_for
from pagoda.router.proxy import WORKER_HEADER

MODEL = "tiny"


def _chat(base: str, content: str, *, session: str | None = None, max_tokens: int = 2,
          system: str = "be brief", key: str | None = None) -> httpx.Response:
    headers = {"X-Session-ID": session} if session else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)


def _sse_events(base: str, body: dict, headers: dict | None = None) -> tuple[list[dict | str], httpx.Headers]:
    events: list[dict | str] = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return events, r.headers


def test_a_session_keeps_its_replica(router, replicas):
    turns: dict[str, list[str]] = {}
    for turn in range(4):
        for s in range(16):
            answer = _chat(router.base, f"turn {turn} of chat {s}", session=f"session-{s}")
            assert answer.status_code == 200, answer.text
            turns.setdefault(f"session-{s}", []).append(answer.headers[WORKER_HEADER])
    stuck = sum(ws.count(Counter(ws).most_common(1)[0][0]) for ws in turns.values())
    assert stuck / (16 * 4) >= 0.99
    assert {ws[0] for ws in turns.values()} == set(replicas)  # sessions spread over both


def test_body_user_is_a_session_key_too(router):
    workers = {httpx.post(f"{router.base}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": f"different prompt {i}", "max_tokens": 1, "user": "u-7"}
                          ).headers[WORKER_HEADER] for i in range(8)}
    assert len(workers) == 1


def test_streaming_through_the_router_equals_streaming_direct(router, replicas):
    body = {"model": MODEL, "temperature": 0, "max_tokens": 24, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Tell me about the quick brown fox"}]}
    via_router, headers = _sse_events(router.base, body)
    direct, _ = _sse_events(headers[WORKER_HEADER], body)
    assert headers["content-type"].startswith("text/event-stream")

    def content(events):
        return [(c["delta"].get("content"), c.get("finish_reason")) for e in events if isinstance(e, dict)
                for c in e["choices"]]

    assert content(via_router) == content(direct)  # chunk by chunk: same deltas, same boundaries
    assert via_router[-1] == "[DONE]"
    usage, direct_usage = via_router[-2]["usage"], direct[-2]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (direct_usage["prompt_tokens"], 24)
    assert direct_usage["completion_tokens"] == 24
    assert direct_usage["prompt_tokens_details"]["cached_tokens"] > 0  # the same replica: its cache held the prompt
    assert "".join(d or "" for d, _ in content(via_router))


def test_openai_sdk_through_the_router(router):
    client = openai.OpenAI(base_url=f"{router.base}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    completion = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=3, temperature=0)
    assert completion.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):  # the worker's own error, passed through
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_cache_aware_sends_each_shared_prefix_family_to_one_replica(router, replicas):
    families = {}
    for f in range(4):
        system = f"Family {f}: you answer questions about topic number {f} in great and careful detail. " * 3
        families[f] = {_chat(router.base, f"question {q}?", system=system).headers[WORKER_HEADER] for q in range(5)}
    assert all(len(workers) == 1 for workers in families.values()), families
    assert {w for workers in families.values() for w in workers} == set(replicas)  # new families spread
    metrics = httpx.get(f"{router.base}/metrics").text
    assert _metric(metrics, 'pagoda_router:routing_decisions_total{reason="prefix"}') >= 16


def test_models_health_metrics_and_other_routes(router, replicas):
    assert httpx.get(f"{router.base}/health").json() == {"status": "ok", "available_workers": 2}
    assert [m["id"] for m in httpx.get(f"{router.base}/v1/models").json()["data"]] == [MODEL]
    tokens = httpx.post(f"{router.base}/tokenize", json={"model": MODEL, "prompt": "hello"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    bad = httpx.post(f"{router.base}/v1/chat/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{router.base}/v1/no-such-route", json={}).status_code == 404  # the worker's 404
    metrics = httpx.get(f"{router.base}/metrics").text
    for replica in replicas:
        assert _metric(metrics, f'pagoda_router:requests_total{{worker="{replica}"}}') > 0
        assert _metric(metrics, f'pagoda_router:worker_healthy{{worker="{replica}"}}') == 1
    assert _metric(metrics, 'pagoda_router:routing_decisions_total{reason="session"}') > 0


def test_admin_routes_need_the_admin_key(router, replicas):
    url = f"{router.base}/workers"
    for method in ("GET", "POST", "DELETE"):
        assert httpx.request(method, url, json={"url": "http://127.0.0.1:1"}).status_code == 401
        wrong = httpx.request(method, url, json={"url": "http://127.0.0.1:1"}, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    listed = httpx.get(url, headers=admin).json()
    assert listed["policy"] == "cache_aware"
    assert {w["url"]: (w["healthy"], w["breaker"]) for w in listed["workers"]} == {
        r: (True, "closed") for r in replicas}
    added = httpx.post(url, json={"url": "http://127.0.0.1:1/"}, headers=admin)  # nothing listens there
    assert added.status_code == 201 and added.json()["url"] == "http://127.0.0.1:1"
    assert added.json()["healthy"] is False
    assert _chat(router.base, "still served").status_code == 200  # the dead one is never chosen
    assert httpx.request("DELETE", url, json={"url": "http://127.0.0.1:1"}, headers=admin).status_code == 200
    assert httpx.delete(url, params={"url": "http://127.0.0.1:1"}, headers=admin).status_code == 404
    assert httpx.post(url, json={"url": "not a url"}, headers=admin).status_code == 400
    assert set(router.workers()) == set(replicas)


def test_a_worker_added_at_run_time_warms_up(replicas):
    r = RouterProcess(replicas[:1], "--warmup-seconds", "60")
    try:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        added = httpx.post(f"{r.base}/workers", json={"url": replicas[1]}, headers=admin).json()
        assert added["healthy"] and 0 < added["weight"] < 0.2  # at the start of its ramp
        assert r.workers()[replicas[0]]["weight"] == 1.0
    finally:
        r.stop()


def test_gateway_limits_answer_429_with_retry_after(replicas):
    r = RouterProcess(replicas, "--qps-per-key", "2", "--max-requests-in-flight", "1")
    try:
        answers = [_chat(r.base, f"q{i}", key="alice", max_tokens=1) for i in range(6)]
        refused = [a for a in answers if a.status_code == 429]
        assert answers[0].status_code == 200 and len(refused) >= 2
        assert refused[0].headers["Retry-After"] == "1"
        assert refused[0].json()["error"]["type"] == "rate_limit_error"
        assert _chat(r.base, "q", key="bob", max_tokens=1).status_code == 200  # bob has his own bucket

        body = {"model": MODEL, "max_tokens": 8000, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "x"}]}
        with httpx.stream("POST", f"{r.base}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer carol"}) as stream:
            chunks = stream.iter_raw()  # kept: a dropped iterator closes the stream
            next(chunks)  # the stream holds the one slot
            busy = _chat(r.base, "q", key="dave", max_tokens=1)
            assert busy.status_code == 429 and "in flight" in busy.json()["error"]["message"]
        wait_for(lambda: _chat(r.base, "q", key=f"erin{time.monotonic()}", max_tokens=1).status_code == 200,
                 what="the slot to be given back")
        metrics = httpx.get(f"{r.base}/metrics").text
        assert _metric(metrics, 'pagoda_router:rate_limited_total{level="key_qps"}') >= 2
        assert _metric(metrics, 'pagoda_router:rate_limited_total{level="in_flight"}') >= 1
    finally:
        r.stop()


def test_overall_qps_limit(replicas):
    r = RouterProcess(replicas, "--qps", "2")
    try:
        codes = [_chat(r.base, "q", key=f"key{i}", max_tokens=1).status_code for i in range(6)]
        assert codes[:2] == [200, 200] and codes.count(429) >= 2
    finally:
        r.stop()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_server_side_sessions_live_on_one_replica(router, replicas):
    """/v1/sessions through the router: a session created without an X-Session-ID gets one from
    the router, and every later call (messages, GET, DELETE) reaches the replica that holds it."""
    workers: dict[str, set[str]] = {}
    for s in range(6):
        created = httpx.post(f"{router.base}/v1/sessions", json={"max_tokens": 2, "temperature": 0}, timeout=60)
        assert created.status_code == 200, created.text
        sid = created.json()["id"]
        workers[sid] = {created.headers[WORKER_HEADER]}
        for turn in range(3):
            answer = httpx.post(f"{router.base}/v1/sessions/{sid}/messages", json={"content": f"turn {turn}"},
                                timeout=60)
            assert answer.status_code == 200, answer.text
            workers[sid].add(answer.headers[WORKER_HEADER])
        state = httpx.get(f"{router.base}/v1/sessions/{sid}", timeout=60)
        assert len(state.json()["messages"]) == 6
        workers[sid].add(state.headers[WORKER_HEADER])
        assert httpx.delete(f"{router.base}/v1/sessions/{sid}", timeout=60).json()["deleted"] is True
    assert all(len(ws) == 1 for ws in workers.values())
    chosen = httpx.post(f"{router.base}/v1/sessions", json={}, headers={"X-Session-ID": "mine-1"}, timeout=60)
    assert chosen.json()["id"] == "mine-1"
    httpx.delete(f"{router.base}/v1/sessions/mine-1", timeout=60)
