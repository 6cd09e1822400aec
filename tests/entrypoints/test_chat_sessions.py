"""`/v1/sessions` on a real `pagoda serve` of the tiny model: a turn computes only its new tokens
(incremental encoding over a pinned prefix), the pin outlives traffic that evicts unpinned
prefixes, a long conversation drops (or summarizes) old turns instead of failing, sessions
expire, and bad calls get clear errors."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from openai import OpenAI
from server_process import start_server, stop_process

BLOCK = 16


@pytest.fixture(scope="module")
def server(long_tiny_llama):
    # 0.001 GiB: 131 blocks of 16 tokens for the tiny model, so a few long prompts fill it
    proc, base = start_server(long_tiny_llama, "--max-model-len", "512", "--kv-cache-memory", "0.001",
                              "--session-ttl", "600", "--max-sessions", "8")
    yield base
    stop_process(proc)


@pytest.fixture(scope="module")
def short_server(long_tiny_llama):
    """A short context (overflow) and a short TTL (expiry)."""
    proc, base = start_server(long_tiny_llama, "--max-model-len", "160", "--session-ttl", "1.5")
    yield base
    stop_process(proc)


def post(base: str, path: str, body: dict, status: int = 200, **kwargs) -> dict:
    answer = httpx.post(f"{base}{path}", json=body, timeout=60, **kwargs)
    assert answer.status_code == status, answer.text
    return answer.json()


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def computed(answer: dict) -> int:
    usage = answer["usage"]
    return usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]


WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def message(i: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(6))


def test_each_turn_computes_only_its_new_tokens(server):
    sid = post(server, "/v1/sessions", {"system": "You are terse.", "max_tokens": 8, "temperature": 0})["id"]
    answers = [post(server, f"/v1/sessions/{sid}/messages", {"content": message(i)}) for i in range(8)]
    prompts = [a["usage"]["prompt_tokens"] for a in answers]
    assert prompts == sorted(prompts) and prompts[-1] > 4 * prompts[0]  # the history grows ...
    new_tokens = [prompts[0]] + [prompts[k] - prompts[k - 1] for k in range(1, len(prompts))]
    for k in range(1, len(answers)):  # ... but a turn computes its new tokens and at most one block more
        assert computed(answers[k]) <= new_tokens[k] + BLOCK, (k, computed(answers[k]), new_tokens[k])
    assert all(a["session_id"] == sid and a["object"] == "chat.completion" for a in answers)
    history = httpx.get(f"{server}/v1/sessions/{sid}", timeout=10).json()
    assert [m["role"] for m in history["messages"]] == ["system"] + ["user", "assistant"] * 8
    assert history["messages"][-1]["content"] == answers[-1]["choices"][0]["message"]["content"]
    assert httpx.delete(f"{server}/v1/sessions/{sid}", timeout=10).json()["deleted"] is True
    assert httpx.get(f"{server}/v1/sessions/{sid}", timeout=10).status_code == 404


def test_the_answer_equals_a_plain_chat_completion_of_the_same_history(server):
    """A session may start from an earlier conversation; its turns then answer as a chat
    completion of the whole history does (the same prompt tokens, the same greedy answer)."""
    earlier = [{"role": "user", "content": message(0)}, {"role": "assistant", "content": "bravo charlie delta"}]
    sid = post(server, "/v1/sessions", {"system": "Be brief.", "messages": earlier, "max_tokens": 12,
                                        "temperature": 0})["id"]
    turn = post(server, f"/v1/sessions/{sid}/messages", {"content": message(1)})
    messages = [{"role": "system", "content": "Be brief."}, *earlier, {"role": "user", "content": message(1)}]
    plain = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert turn["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert turn["choices"][0]["message"] == plain["choices"][0]["message"]
    bad = post(server, "/v1/sessions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400)
    assert bad["error"]["param"] == "messages"
    httpx.delete(f"{server}/v1/sessions/{sid}", timeout=10)


def test_a_pinned_prefix_outlives_traffic_that_evicts_the_rest(server):
    """Between two turns other requests need every unpinned block: a pasted history is evicted,
    the session's is not."""
    history = " ".join(message(i) for i in range(12))
    sid = post(server, "/v1/sessions", {"max_tokens": 4, "temperature": 0})["id"]
    post(server, f"/v1/sessions/{sid}/messages", {"content": history})
    pasted = [{"role": "user", "content": "again: " + history}]  # shares no block with the session
    post(server, "/v1/chat/completions", {"messages": pasted, "max_tokens": 4, "temperature": 0})
    assert metric(server, "pagoda:sessions_pinned") >= 1
    for i in range(8):  # distinct long prompts: LRU eviction takes whatever is not pinned
        post(server, "/v1/completions", {"prompt": f"{i} " + " ".join(reversed(history.split())),
                                         "max_tokens": 2, "temperature": 0})
    turn = post(server, f"/v1/sessions/{sid}/messages", {"content": "and one more"})
    repeat = post(server, "/v1/chat/completions", {"messages": pasted, "max_tokens": 4, "temperature": 0})
    assert computed(turn) <= 32, turn["usage"]
    assert computed(repeat) > repeat["usage"]["prompt_tokens"] // 2, repeat["usage"]
    httpx.delete(f"{server}/v1/sessions/{sid}", timeout=10)


def test_streaming_turns_and_the_openai_sdk(server):
    sid = post(server, "/v1/sessions", {"system": "Answer briefly.", "temperature": 0, "max_tokens": 10})["id"]
    chunks = _stream(server, sid, message(3))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 10 and all(c["session_id"] == sid for c in chunks)
    history = httpx.get(f"{server}/v1/sessions/{sid}", timeout=10).json()["messages"]
    assert history[-1] == {"role": "assistant", "content": text}
    client = OpenAI(base_url=f"{server}/v1", api_key="unused")  # the SDK's generic POST, on our route
    answer = client.post(f"/sessions/{sid}/messages", body={"content": message(4)}, cast_to=httpx.Response)
    assert answer.json()["usage"]["prompt_tokens"] > chunks[-1]["usage"]["prompt_tokens"]
    httpx.delete(f"{server}/v1/sessions/{sid}", timeout=10)


def _stream(base: str, sid: str, content: str) -> list[dict]:
    import json

    chunks = []
    with httpx.stream("POST", f"{base}/v1/sessions/{sid}/messages", timeout=60,
                      json={"content": content, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_long_conversation_drops_old_turns_instead_of_failing(short_server):
    sid = post(short_server, "/v1/sessions", {"system": "Be brief.", "max_tokens": 8, "temperature": 0})["id"]
    for i in range(10):
        answer = post(short_server, f"/v1/sessions/{sid}/messages", {"content": message(i) + " " + message(i + 1)})
        assert answer["usage"]["prompt_tokens"] + 8 <= 160
    state = httpx.get(f"{short_server}/v1/sessions/{sid}", timeout=10).json()
    assert state["dropped_turns"] > 0 and state["messages"][0] == {"role": "system", "content": "Be brief."}
    assert state["messages"][-2]["content"] == message(9) + " " + message(10)  # the latest turns stay


def test_summarize_keeps_a_summary_of_dropped_turns(short_server):
    sid = post(short_server, "/v1/sessions", {"max_tokens": 4, "temperature": 0, "overflow": "summarize"})["id"]
    for i in range(8):
        post(short_server, f"/v1/sessions/{sid}/messages", {"content": message(i) + " " + message(i + 2)})
    state = httpx.get(f"{short_server}/v1/sessions/{sid}", timeout=10).json()
    assert state["dropped_turns"] > 0 and state["summary"]
    assert state["messages"][0]["role"] == "system" and state["summary"] in state["messages"][0]["content"]


def test_idle_sessions_expire_and_let_their_pins_go(short_server):
    sid = post(short_server, "/v1/sessions", {"max_tokens": 2, "temperature": 0})["id"]
    post(short_server, f"/v1/sessions/{sid}/messages", {"content": message(0) * 3})
    deadline = time.monotonic() + 30
    while httpx.get(f"{short_server}/v1/sessions/{sid}", timeout=10).status_code != 404:
        assert time.monotonic() < deadline, "the session never expired"
        time.sleep(0.2)
    while metric(short_server, "pagoda:sessions_pinned") != 0:
        assert time.monotonic() < deadline, "the expired session's pin was never released"
        time.sleep(0.2)


def test_bad_calls_get_clear_errors(server):
    assert post(server, "/v1/sessions/nope/messages", {"content": "hi"}, 404)["error"]["code"] == "session_not_found"
    assert post(server, "/v1/sessions", {"model": "other"}, 404)["error"]["param"] == "model"
    assert post(server, "/v1/sessions", {"temperature": -1}, 400)["error"]["param"] == "temperature"
    assert post(server, "/v1/sessions", {"n": 2}, 400)["error"]["param"] == "n"
    sid = post(server, "/v1/sessions", {}, headers={"X-Session-ID": "client-chosen.1"})["id"]
    assert sid == "client-chosen.1"
    assert post(server, "/v1/sessions", {}, 409, headers={"X-Session-ID": sid})["error"]["code"] == "session_exists"
    assert post(server, f"/v1/sessions/{sid}/messages", {}, 400)["error"]["param"] == "content"
    huge = post(server, f"/v1/sessions/{sid}/messages", {"content": "word " * 600, "max_tokens": 4}, 400)
    assert huge["error"]["code"] == "context_length_exceeded"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert post(server, f"/v1/sessions/{sid}/messages", {"content": "hi", "tools": tools}, 400)["error"]["param"] == "tools"
    post(server, f"/v1/sessions/{sid}/messages", {"content": "still fine", "max_tokens": 2})
    httpx.delete(f"{server}/v1/sessions/{sid}", timeout=10)
    while metric(server, "pagoda:num_requests_running") != 0:
        time.sleep(0.05)
    assert metric(server, "pagoda:kv_cache_usage_perc") == 0.0  # nothing leaked
