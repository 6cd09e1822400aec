"""The audit log (issue 15) on one real `pagoda serve --api-key K --audit-log FILE` (the one-key
shorthand, so also `--api-key` through the access middleware and gRPC): one JSON line per
request with its status, tokens and latency, never the prompt or output text (without
--audit-log-content; tests/security/test_auth.py has the lines with it, and with tenants),
rotated by size into the number of backups asked for."""

from __future__ import annotations

import json
import time
import uuid

import grpc
import httpx
import openai
import pytest
from server_process import _free_port, start_server, stop_process

KEY = "audit-test-key"
MAX_BYTES = 2048
BACKUPS = 2


@pytest.fixture(scope="module")
def srv(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    words = log.with_name("blocked.txt")  # a content-filter list: its hits reach the audit line
    words.write_text("zorblax\n")
    grpc_port = _free_port()
    proc, base = start_server(tiny_llama, "--api-key", KEY, "--audit-log", str(log), "--audit-log-max-bytes",
                              str(MAX_BYTES), "--audit-log-backups", str(BACKUPS), "--grpc-port", str(grpc_port),
                              "--moderation-words", str(words))
    yield base, log, f"127.0.0.1:{grpc_port}"
    stop_process(proc)


def records(log) -> list[dict]:
    """Every line of the log and its backups, oldest first."""
    files = [log.with_name(f"{log.name}.{i}") for i in range(BACKUPS, 0, -1)] + [log]
    return [json.loads(line) for f in files if f.exists() for line in f.read_text().splitlines()]


def wait_for(log, predicate, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in records(log) if predicate(r)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_api_key_shorthand_and_lines_without_text(srv):
    base, log, _ = srv
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    marker = f"secret-{uuid.uuid4().hex}"
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": marker}], max_tokens=16,
                                            extra_body={"ignore_eos": True})
    output = answer.choices[0].message.content
    stream = client.completions.create(model="tiny", prompt=marker, max_tokens=16, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    chat = wait_for(log, lambda r: r["path"] == "/v1/chat/completions" and r["status"] == 200)
    done = wait_for(log, lambda r: r["path"] == "/v1/completions" and r["completion_tokens"] == 16)
    assert chat and done
    rec = chat[-1]
    assert set(rec) == {"time", "method", "path", "client", "tenant", "key_id", "role", "model", "status",
                        "prompt_tokens", "completion_tokens", "cached_tokens", "latency_ms", "filter_hits"}
    assert (rec["tenant"], rec["key_id"], rec["model"], rec["client"]) == (None, None, "tiny", "127.0.0.1")
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (answer.usage.prompt_tokens, 16)
    assert rec["latency_ms"] > 0 and rec["filter_hits"] == [] and rec["time"].endswith("Z")
    text = "".join(f.read_text() for f in log.parent.iterdir())
    assert marker not in text and KEY not in text
    for generated in (output, streamed):  # (a text of a few characters could be in a line by chance)
        assert len(generated.strip()) < 8 or generated.strip() not in text
    assert any(r["status"] == 401 and r["path"] == "/v1/models" for r in records(log))
    assert not any(r["path"] in ("/health", "/metrics") for r in records(log))


def test_filter_hits_without_the_text(srv):
    base, log, _ = srv
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "say zorblax twice", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter"
    (rec,) = wait_for(log, lambda rec: rec["filter_hits"])
    assert rec["filter_hits"] == ["blocked"] and rec["status"] == 400
    assert "zorblax" not in "".join(f.read_text() for f in log.parent.glob("audit.jsonl*"))


def test_rotated_by_size(srv):
    base, log, _ = srv
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(headers=headers, timeout=30) as c:
        for _ in range(30):  # ~300 bytes a line: several rotations
            assert c.post(f"{base}/tokenize", json={"prompt": "Hi"}).status_code == 200
    kept = [log, *(log.with_name(f"{log.name}.{i}") for i in range(1, BACKUPS + 1))]
    assert all(f.exists() for f in kept), sorted(p.name for p in log.parent.iterdir())
    assert not log.with_name(f"{log.name}.{BACKUPS + 1}").exists()
    for f in kept:
        assert f.stat().st_size <= MAX_BYTES and (f.stat().st_mode & 0o777) == 0o600
        assert all(json.loads(line)["path"] for line in f.read_text().splitlines())  # whole lines only
    times = [r["time"] for r in records(log)]
    assert times == sorted(times)


def test_grpc_takes_the_api_key(srv):
    from pagoda.client import EngineClient

    _, log, target = srv
    with EngineClient(target, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.list_models()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with EngineClient(target, api_key=KEY, timeout=30) as c:
        assert c.list_models() == ["tiny"]
        pieces = list(c.generate("Hi", max_tokens=2, ignore_eos=True))  # (sampled text may be empty)
        assert sum(len(p.token_ids) for p in pieces) == 2
    # one audit line per call, as for HTTP: the code's name as its status, tokens, no text
    [refused] = wait_for(log, lambda r: r["method"] == "gRPC" and r["status"] == "UNAUTHENTICATED")
    assert refused["path"] == "/pagoda.v1.Engine/ListModels"
    [generated] = wait_for(log, lambda r: r["path"] == "/pagoda.v1.Engine/Generate")
    assert generated["status"] == "OK" and generated["completion_tokens"] == 2 and generated["prompt_tokens"] > 0
    assert generated["model"] == "tiny" and "prompts" not in generated
