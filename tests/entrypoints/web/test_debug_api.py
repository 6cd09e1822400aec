"""The JSON debug API (/v1/debug/...) over HTTP against real servers: the engine on a thread
(with --api-key) and in its own process (with --auth-config and --no-web-ui)."""

from __future__ import annotations

import contextlib
import io
import json

import httpx
import pytest
from server_process import start_server, stop_process

from pagoda.cli import main as pagoda_main
from pagoda.layers.cpu_kernels import load_cpu_kernels

API_KEY = "web-test-key"
SYSTEM = "You are a helpful assistant who answers about Paris, the capital of France. " * 4


def _add_key(path, tenant: str, role: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pagoda_main(["keys", "add", str(path), "--tenant", tenant, "--role", role]) == 0
    return out.getvalue().strip().splitlines()[-1]


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request, tiny_llama, tmp_path_factory):
    """(base URL, admin headers, the mode's extras) of a server in each engine mode."""
    if request.param == "thread":
        proc, base = start_server(tiny_llama, "--api-key", API_KEY)
        keys = {"admin": API_KEY}
    else:
        config = tmp_path_factory.mktemp("web-auth") / "auth.yaml"
        config.write_text(json.dumps({"roles": {"user": {"models": ["*"]}, "ops": {"models": ["*"], "admin": True}}}))
        keys = {"admin": _add_key(config, "ops", "ops"), "user": _add_key(config, "acme", "user")}
        proc, base = start_server(tiny_llama, "--engine-process", "--auth-config", str(config), "--no-web-ui")
    yield request.param, base, {name: {"Authorization": f"Bearer {key}"} for name, key in keys.items()}
    stop_process(proc)


def _chat(base: str, headers: dict, content: str, max_tokens: int = 8) -> dict:
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _get(base: str, path: str, headers: dict, **params) -> dict:
    r = httpx.get(f"{base}{path}", params=params, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_steps_engine_and_radix_describe_what_ran(served):
    mode, base, keys = served
    admin = keys["admin"]
    first = _chat(base, admin, "Hello")
    second = _chat(base, admin, "What is there to see?", max_tokens=5)  # the system prompt comes from the cache

    requests = _get(base, "/v1/debug/requests", admin, model="tiny")
    assert requests["object"] == "debug.requests" and requests["model"] == "tiny"
    by_id = {r["request_id"].rsplit("-", 1)[0]: r for r in requests["requests"]}
    for answer in (first, second):
        trace = by_id[answer["id"]]
        usage = answer["usage"]
        assert trace["state"] == "finished" and trace["finish_reason"] == "length"
        assert trace["prompt_tokens"] == usage["prompt_tokens"]
        assert trace["output_tokens"] == usage["completion_tokens"]
        assert trace["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert sum(c["tokens"] for c in trace["prefill_chunks"]) == trace["prompt_tokens"] - trace["cached_tokens"]
        assert 0 <= trace["queued_ms"] <= trace["prefill_chunks"][0]["start_ms"] < trace["first_token_ms"]
        assert trace["first_token_ms"] <= trace["total_ms"] and trace["mean_itl_ms"] > 0
    assert by_id[second["id"]]["cached_tokens"] >= 32  # the shared system prompt's full blocks
    assert requests["requests"][0]["arrival"] >= requests["requests"][1]["arrival"]  # newest first

    steps = _get(base, "/v1/debug/steps", admin, limit=20)["steps"]
    assert [s["step"] for s in steps] == sorted((s["step"] for s in steps), reverse=True)
    assert sum(s["generated_tokens"] for s in steps) >= 5  # at least the second answer's steps
    assert all(s["duration_ms"] > 0 and s["prefill_tokens"] + s["decode_tokens"] > 0 for s in steps)

    engine = _get(base, "/v1/debug/engine", admin)
    stats = engine["stats"]
    assert engine["num_steps"] >= 13 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["prefix_cache_hit_tokens"] >= 32 and 0 < stats["prefix_cache_hit_rate"] < 1
    assert stats["memory_pressure"] == stats["kv_cache_usage"] == 0
    assert engine["config"]["block_size"] == 16 and len(engine["series"]) == 60
    forward = engine["config"]["forward"]  # the decode path chosen at start, and why
    assert forward["fused_decode"] == (load_cpu_kernels() is not None) and forward["reason"]
    assert sum(p["generated_tokens"] for p in engine["series"]) + engine["window"]["generation_tokens_per_s"] >= 0

    radix = _get(base, "/v1/debug/radix", admin)
    assert radix["enabled"] and radix["cached_blocks"] >= 2
    deepest = radix["nodes"][radix["prefixes"][0]["node"]]
    assert deepest["prefix_tokens"] == radix["prefixes"][0]["prefix_tokens"] >= 32
    assert "Paris" in "".join(n["preview"] for n in radix["nodes"])  # the system prompt, as text
    assert all(n["age_s"] is not None and n["age_s"] >= 0 for n in radix["nodes"] if n["parent"] is not None)


def test_stream_sends_all_views_a_few_times_a_second(served):
    _, base, keys = served
    events = []
    with httpx.stream("GET", f"{base}/v1/debug/stream", params={"interval": 0.1}, headers=keys["admin"],
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break
    assert all({"engine", "steps", "requests", "radix"} <= set(e) and e["model"] == "tiny" for e in events)
    assert events[0]["engine"]["time"] < events[2]["engine"]["time"]


def test_bad_queries_are_400s(served):
    _, base, keys = served
    r = httpx.get(f"{base}/v1/debug/steps", params={"limit": 0}, headers=keys["admin"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.limit"
    r = httpx.get(f"{base}/v1/debug/stream", params={"interval": 0}, headers=keys["admin"])
    assert r.status_code == 400 and "interval" in r.json()["error"]["param"]


def test_debug_data_needs_the_admin_key(served):
    mode, base, keys = served
    assert httpx.get(f"{base}/v1/debug/engine").status_code == 401
    if mode == "thread":  # --api-key: the key is enough; the pages load without it
        assert httpx.get(f"{base}/").status_code == 200 and httpx.get(f"{base}/dashboard").status_code == 200
        assert httpx.get(f"{base}/web/vendor/marked/LICENSE").status_code == 200
    else:  # --auth-config: only a role with admin: true; --no-web-ui: no pages
        r = httpx.get(f"{base}/v1/debug/engine", headers=keys["user"])
        assert r.status_code == 403 and "debug data" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/", headers=keys["admin"]).status_code == 404
        assert httpx.get(f"{base}/dashboard", headers=keys["admin"]).status_code == 404
