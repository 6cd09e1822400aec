"""Keys, tenants and roles (issue 15), against one real `pagoda serve --auth-config` on 127.0.0.1
with the openai SDK, httpx, raw sockets and the gRPC client: 401 / 403 / 429 with OpenAI-style
bodies, /v1/models filtered by role, each limit (requests per second, requests at once, tokens
per minute, max_tokens), the role's priority in the scheduler, per-tenant prefix-cache salts,
the audit line with --audit-log-content, SIGHUP reload with a stream in flight, slow clients,
model names that are paths, and a schemathesis run with and without a key that leaves no KV
block behind. `pagoda keys` writes the keys; tests/security/test_audit.py covers --api-key and
the audit log without text."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest
from server_process import _free_port, start_server, stop_process

from pagoda.bench.servers import IDLE_METRICS, scrape_metrics, wait_idle
from pagoda.cli import main as pagoda_main
from pagoda.security.auth import AuthConfig, split_key
from pagoda.security.context import Grant, RequestContext
from pagoda.security.limits import TenantLimits

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import fuzz_server

READ_TIMEOUT = 2.0
ROLES = """\
roles:
  basic: {models: [tiny], max_tokens: 8}
  pro: {models: ["tiny*"], priority: 10}
  bulk: {models: [tiny]}
  admin: {models: ["*"], admin: true}
  ratey: {models: [tiny], requests_per_second: 0.1, burst: 2}
  single: {models: [tiny], max_concurrent: 1}
  tokeny: {models: [tiny], tokens_per_minute: 40}
  nothing: {models: []}
"""
KEYS = {  # name: (tenant, role)
    "acme1": ("acme", "basic"), "acme2": ("acme", "basic"), "beta": ("beta", "pro"), "bulk": ("bulkco", "bulk"),
    "ops": ("ops", "admin"), "rate": ("rateco", "ratey"), "single": ("singleco", "single"),
    "tok": ("tokco", "tokeny"), "none": ("noneco", "nothing"), "gone": ("goneco", "basic"),
}
KEY_FORM = re.compile(r"^pk-[0-9a-f]{12}-[A-Za-z0-9_-]{43}$")


def add_key(path: Path, tenant: str, role: str) -> str:
    """`pagoda keys add` in this process; the key is the last line it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pagoda_main(["keys", "add", str(path), "--tenant", tenant, "--role", role]) == 0
    return out.getvalue().strip().splitlines()[-1]


@pytest.fixture(scope="module")
def srv(long_tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    config, audit = root / "auth.yaml", root / "audit.jsonl"
    config.write_text(ROLES)
    keys = {name: add_key(config, tenant, role) for name, (tenant, role) in KEYS.items()}
    grpc_port = _free_port()
    proc, base = start_server(long_tiny_llama, "--max-model-len", "4096", "--served-model-name", "tiny", "tiny-pro",
                              "--auth-config", str(config),
                              "--audit-log", str(audit), "--audit-log-content", "--read-timeout", str(READ_TIMEOUT),
                              "--max-num-seqs", "2", "--grpc-port", str(grpc_port),
                              "--session-ttl", "5")  # the fuzz test's stored responses let their pins go by then
    log = fuzz_server.drain_log(proc)
    with httpx.Client(timeout=60) as http:
        yield SimpleNamespace(base=base, keys=keys, config=config, audit=audit, proc=proc, log=log, root=root,
                              grpc=f"127.0.0.1:{grpc_port}", http=http)
    stop_process(proc)


def sdk(srv, key: str | None, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base}/v1", api_key=srv.keys.get(key, key) or "none", max_retries=0,
                         timeout=60, **kw)


def post(srv, path: str, key: str | None, body: dict, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {srv.keys.get(key, key)}"} if key else {}
    return srv.http.post(f"{srv.base}{path}", json=body, headers=headers, **kw)


def error_of(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and set(err) == {"message", "type", "param", "code"}, err
    return err


# -- unit checks of the pieces (no server) ----------------------------------------------------------
def test_key_format_hash_and_file_hold_no_key(tmp_path):
    path = tmp_path / "auth.json"  # JSON works as YAML does
    path.write_text(json.dumps({"roles": {"r": {"models": ["*"]}}}))
    path.chmod(0o640)
    key = add_key(path, "t", "r")
    assert path.stat().st_mode & 0o777 == 0o640  # the file keeps its mode
    assert KEY_FORM.match(key)
    key_id, secret = split_key(key)
    text = path.read_text()
    assert key_id in text and secret not in text and key not in text
    config = AuthConfig.load(path)
    assert config.authenticate(key).tenant == "t"
    for wrong in ("", key[:-1] + ("A" if key[-1] != "A" else "B"), key.replace(key_id, "0" * 12), "Bearer " + key,
                  f"pk-{key_id}", secret):
        assert config.authenticate(wrong) is None


def test_keys_command_lines(tmp_path):
    """The real CLI: `add` prints the key once as its last line, `list` shows ids not keys,
    `revoke` marks the key, which then fails; a wrong role or file is an error."""
    path = tmp_path / "auth.yaml"
    path.write_text(ROLES)
    run = lambda *a: subprocess.run([sys.executable, "-m", "pagoda.cli", "keys", *a],
                                    capture_output=True, text=True, timeout=60)
    added = run("add", str(path), "--tenant", "acme", "--role", "basic", "--name", "ci")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip().splitlines()[-1]
    assert KEY_FORM.match(key) and added.stdout.count(key) == 1
    key_id = split_key(key)[0]
    listed = run("list", str(path))
    assert listed.returncode == 0 and key_id in listed.stdout and "active" in listed.stdout
    assert split_key(key)[1] not in listed.stdout
    assert run("revoke", str(path), key_id).returncode == 0
    assert "revoked" in run("list", str(path)).stdout
    assert AuthConfig.load(path).authenticate(key) is None
    bad = run("add", str(path), "--tenant", "acme", "--role", "nope")
    assert bad.returncode == 1 and "role 'nope' is not in" in bad.stderr
    assert run("add", str(tmp_path / "missing.yaml"), "--tenant", "a", "--role", "basic").returncode == 1


def test_limit_arithmetic():
    role = AuthConfig.from_dict({"roles": {"r": {"models": ["*"], "requests_per_second": 2, "burst": 3,
                                                 "max_concurrent": 2, "tokens_per_minute": 100}}}).roles["r"]
    limits = TenantLimits()
    assert [limits.take_request(role, now=10.0) is None for _ in range(4)] == [True, True, True, False]
    assert limits.take_request(role, now=10.5) is None  # +1 token after half a second at 2/s
    _, code, retry = limits.take_request(role, now=10.5)
    assert code == "rate_limit_exceeded" and retry == pytest.approx(0.5)
    assert limits.admit(role, now=0.0) is None and limits.admit(role, now=0.0) is None
    assert limits.admit(role, now=0.0)[1] == "concurrency_limit_exceeded"
    limits.release(2)
    limits.charge(60, now=1.0)
    limits.charge(50, now=20.0)
    _, code, retry = limits.admit(role, now=30.0)
    assert code == "token_limit_exceeded" and retry == pytest.approx(31.0)  # the first 60 leave at t=61
    assert limits.admit(role, now=61.5) is None


def test_priority_and_salt_rules():
    config = AuthConfig.from_dict({"roles": {"vip": {"models": ["*"], "priority": 10}}})
    from pagoda.security.auth import KeyEntry

    grant = Grant(KeyEntry("0" * 12, "acme", "vip", "x"), config.roles["vip"], TenantLimits())
    ctx = RequestContext(grant)
    assert ctx.engine_args(0, None) == (10, "tenant/acme")
    assert ctx.engine_args(100, "s") == (10, "tenant/acme/s")  # a request cannot raise its priority
    assert ctx.engine_args(-3, None)[0] == 7  # but may lower it
    assert RequestContext(None).engine_args(5, "s") == (5, "s")


def test_bad_config_files_are_refused(tmp_path):
    from pagoda.security.auth import AuthConfigError

    for text, words in [("roles: [", "not valid YAML"), ("roles: {r: {models: [x], max_tokens: 0}}", "max_tokens"),
                        ("roles: {r: {modles: [x]}}", "unknown field"), ("keys: [{id: x}]", "missing"),
                        ("roles: {r: {}}\nkeys: [{id: 000000000000, tenant: t, role: r, hash: h}]", "quote it"),
                        ("roles: {r: {}}\nkeys: [{id: 'abcdefabcdef', tenant: t, role: r, hash: h}]", "hash"),
                        ("roles: {r: {}}\nkeys: [{id: 'abcdefabcdef', tenant: t, role: q, hash: h}]", "hash"),
                        ("roles: {r: {}}\nkeys: [{id: 'abcdefabcdef', tenant: 'a/b', role: r, hash: h}]", "tenant")]:
        path = tmp_path / "a.yaml"
        path.write_text(text)
        with pytest.raises(AuthConfigError, match=words):
            AuthConfig.load(path)


# -- keys and roles on the server ------------------------------------------------------------------
def test_missing_or_unknown_key_is_401(srv):
    key_id = split_key(srv.keys["acme1"])[0]
    for given in (None, "wrong", f"pk-{key_id}-{'A' * 43}", f"pk-{'0' * 12}-{'A' * 43}"):
        r = post(srv, "/v1/completions", given, {"prompt": "Hi", "max_tokens": 1})
        assert error_of(r, 401, "invalid_api_key")["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        sdk(srv, "nope").models.list()
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{srv.base}{open_path}").status_code == 200


@pytest.mark.parametrize("key, allowed", [
    ("acme1", {"tiny"}), ("beta", {"tiny", "tiny-pro"}), ("ops", {"tiny", "tiny-pro"}), ("none", set()),
])
def test_roles_by_models(srv, key, allowed):
    client = sdk(srv, key)
    assert {m.id for m in client.models.list()} == allowed
    for model in ("tiny", "tiny-pro"):
        calls = {
            "completions": lambda m=model: client.completions.create(model=m, prompt="Hi", max_tokens=2),
            "chat": lambda m=model: client.chat.completions.create(model=m, max_tokens=2,
                                                                   messages=[{"role": "user", "content": "Hi"}]),
        }
        for what, call in calls.items():
            if model in allowed:
                assert call().usage.completion_tokens >= 1, what
            else:
                with pytest.raises(openai.PermissionDeniedError) as e:
                    call()
                assert e.value.body["code"] == "model_not_allowed" and e.value.body["param"] == "model", what
        others = [post(srv, "/tokenize", key, {"model": model, "prompt": "Hi"}),
                  post(srv, "/v1/sessions", key, {"model": model}),
                  post(srv, "/api/generate", key, {"model": model, "prompt": "Hi", "stream": False,
                                                   "options": {"num_predict": 2}})]
        assert [r.status_code for r in others] == [200 if model in allowed else 403] * 3, [r.text for r in others]
    tags = httpx.get(f"{srv.base}/api/tags", headers={"Authorization": f"Bearer {srv.keys[key]}"}).json()
    assert {m["name"] for m in tags["models"]} >= allowed
    assert not {"tiny", "tiny-pro"} - allowed & {m["name"] for m in tags["models"]}
    # An unknown model is a 404 that names only what the key may use.
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert ("tiny-pro" in e.value.body["message"]) == ("tiny-pro" in allowed)


def test_store_write_routes_need_admin(srv):
    for path in ("/api/delete", "/api/copy", "/api/pull", "/api/create", "/api/push"):
        error_of(post(srv, path, "beta", {"model": "nothing-here"}), 403, "admin_required")
    r = httpx.request("DELETE", f"{srv.base}/api/delete", json={"model": "nothing-here"},
                      headers={"Authorization": f"Bearer {srv.keys['ops']}"})
    assert r.status_code == 404, r.text  # admin: the store answers


def test_another_tenants_session_does_not_exist(srv):
    sid = post(srv, "/v1/sessions", "acme1", {}).json()["id"]
    assert httpx.get(f"{srv.base}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {srv.keys['acme2']}"}
                     ).status_code == 200  # the same tenant's other key
    for path in (f"/v1/sessions/{sid}/messages",):
        assert post(srv, path, "beta", {"content": "Hi"}).status_code == 404
    assert httpx.delete(f"{srv.base}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {srv.keys['beta']}"}
                        ).status_code == 404
    assert post(srv, f"/v1/sessions/{sid}/messages", "acme1", {"content": "Hi", "max_tokens": 2}).status_code == 200
    assert httpx.delete(f"{srv.base}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {srv.keys['acme2']}"}
                        ).status_code == 200  # (its pinned prefix goes with it)


def test_session_ids_are_per_tenant(srv):
    """An X-Session-ID another tenant uses answers as an unused one does (no 409 to probe with):
    each tenant gets its own session of that id; only the same tenant's second one is a 409."""
    sid = f"chat-{uuid.uuid4().hex[:8]}"

    def create(key: str, system: str) -> httpx.Response:
        return srv.http.post(f"{srv.base}/v1/sessions", json={"system": system, "max_tokens": 2, "temperature": 0},
                             headers={"Authorization": f"Bearer {srv.keys[key]}", "X-Session-ID": sid})

    def get(key: str) -> httpx.Response:
        return srv.http.get(f"{srv.base}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {srv.keys[key]}"})

    assert create("acme1", "You are acme's.").json()["id"] == sid
    assert create("beta", "You are beta's.").json()["id"] == sid  # before: 409 "already exists"
    error_of(create("acme2", "again"), 409, "session_exists")  # the same tenant's own id
    assert get("acme2").json()["messages"][0]["content"] == "You are acme's."
    assert get("beta").json()["messages"][0]["content"] == "You are beta's."
    for key in ("beta", "acme1"):  # each a turn of its own (their pinned prefixes are apart)
        assert post(srv, f"/v1/sessions/{sid}/messages", key, {"content": "Hi"}).json()["session_id"] == sid
    assert [m["role"] for m in get("acme1").json()["messages"]] == ["system", "user", "assistant"]
    assert srv.http.delete(f"{srv.base}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {srv.keys['beta']}"}
                           ).status_code == 200
    assert get("beta").status_code == 404 and get("acme1").status_code == 200
    assert srv.http.delete(f"{srv.base}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {srv.keys['acme1']}"}
                           ).status_code == 200


def test_files_batches_and_responses_are_the_tenants_own(srv):
    """Another tenant's file, batch job and stored response do not exist for it; a job runs under
    the key that created it (the role's max_tokens refuses a line that asks more)."""
    acme, acme2, beta = sdk(srv, "acme1"), sdk(srv, "acme2"), sdk(srv, "beta")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    lines = [{"custom_id": "fits", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "max_tokens": 4}},
             {"custom_id": "over", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "max_tokens": 50}}]
    file = acme.files.create(file=("b.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = acme.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: beta.files.retrieve(file.id), lambda: beta.batches.retrieve(batch.id),
                 lambda: beta.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file.id not in [f.id for f in beta.files.list().data] and not beta.batches.list().data
    deadline = time.monotonic() + 60
    while (done := acme2.batches.retrieve(batch.id)).status not in ("completed", "failed"):  # the same tenant's key
        assert time.monotonic() < deadline, done
        time.sleep(0.1)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 1)
    (refused,) = [json.loads(line) for line in acme.files.content(done.error_file_id).text.splitlines()]
    assert refused["custom_id"] == "over" and refused["response"]["body"]["error"]["code"] == "max_tokens_exceeded"
    response = acme.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    assert acme2.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.create(model="tiny", input="Hi", max_output_tokens=2, previous_response_id=response.id)
    acme2.responses.delete(response.id)  # (and its pinned prefix)


# -- limits ---------------------------------------------------------------------------------------
def test_role_max_tokens(srv):
    client = sdk(srv, "acme1")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=9)
    assert e.value.body["code"] == "max_tokens_exceeded" and e.value.body["param"] == "max_tokens"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"ignore_eos": True})  # no max_tokens: the role's 8
    assert chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "length"
    ollama = post(srv, "/api/generate", "acme1", {"model": "tiny", "prompt": "Hi", "stream": False,
                                                  "options": {"num_predict": 50}}).json()
    assert ollama["eval_count"] <= 8  # Ollama's num_predict is cut, as Ollama cuts it at the context's end


def test_requests_per_second(srv):
    client = sdk(srv, "rate")
    statuses = []
    for _ in range(3):  # burst 2 at 0.1/s
        try:
            client.models.list()
            statuses.append(200)
        except openai.RateLimitError as e:
            statuses.append(429)
            assert e.body["code"] == "rate_limit_exceeded"
            assert 1 <= int(e.response.headers["retry-after"]) <= 10
    assert statuses == [200, 200, 429]


def test_max_concurrent(srv):
    client = sdk(srv, "single")
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True,
                                            max_tokens=3000, extra_body={"ignore_eos": True})
    next(iter(stream))  # the first chunk: the request holds its slot
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=1)
    assert e.value.body["code"] == "concurrency_limit_exceeded" and e.value.response.headers["retry-after"] == "1"
    stream.close()  # the server aborts it, which gives the slot back
    deadline = time.monotonic() + 10
    while True:
        try:
            assert client.completions.create(model="tiny", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
            break
        except openai.RateLimitError:  # the server notices the client left at its next write
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_tokens_per_minute(srv):
    client = sdk(srv, "tok")
    first = client.completions.create(model="tiny", prompt="Hello there", max_tokens=40, extra_body={"ignore_eos": True})
    assert first.usage.total_tokens > 40
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=1)
    assert e.value.body["code"] == "token_limit_exceeded"
    assert 50 <= int(e.value.response.headers["retry-after"]) <= 60


def test_role_priority_jumps_the_queue(srv):
    """Two sequences run at once (--max-num-seqs 2): two long bulk streams hold both, and bulk
    requests queue behind them. A pro request (priority 10) preempts a stream and is served while
    the queue waits; a bulk request asking priority 100 is not (a request may lower its role's
    priority, never raise it): when the streams leave, it waits its turn behind the earlier bulk."""
    done: list[str] = []
    lock = threading.Lock()

    def run(key: str, label: str, tokens: int, priority: int = 0) -> None:
        sdk(srv, key).completions.create(model="tiny", prompt="Hi", max_tokens=tokens,
                                         extra_body={"ignore_eos": True, "priority": priority})
        with lock:
            done.append(label)

    def until_waiting(count: int) -> None:
        deadline = time.monotonic() + 60
        while scrape_metrics(srv.base).get("pagoda:num_requests_waiting", 0) < count:
            assert time.monotonic() < deadline, f"{count} requests did not queue"
            time.sleep(0.02)

    holders = [sdk(srv, "bulk").completions.create(model="tiny", prompt="Hi", max_tokens=3000, stream=True,
                                                   extra_body={"ignore_eos": True}) for _ in range(2)]
    for stream in holders:
        next(iter(stream))  # both are running
    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(run, "bulk", f"bulk{i}", 50) for i in range(2)]
        until_waiting(2)
        jobs.append(pool.submit(run, "bulk", "bulk-asking-100", 4, priority=100))
        until_waiting(3)
        pool.submit(run, "beta", "pro", 4).result(timeout=120)
        assert done == ["pro"]  # the holders are still running: it took one's place for a while
        assert scrape_metrics(srv.base)["pagoda:num_requests_waiting"] == 3
        for stream in holders:
            stream.close()  # the server aborts them at its next write: their sequences free up
        for j in jobs:
            j.result(timeout=120)
    assert done[1] in ("bulk0", "bulk1"), done  # bulk-asking-100 started only when one of them ended


def test_prefix_cache_salt_per_tenant(srv):
    prompt = " ".join(uuid.uuid4().hex for _ in range(3))  # ~100 tokens, seen by no other test

    def cached(key: str, **extra) -> int:
        r = post(srv, "/v1/completions", key, {"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("acme1") == 0
    assert cached("acme2") > 0  # the same tenant's other key shares the cache
    assert cached("beta") == 0  # another tenant: nothing, not even by timing
    assert cached("beta", cache_salt="tenant/acme") == 0  # a salt of its own stays inside its tenant's
    assert cached("beta") > 0


def test_audit_line_with_content(srv):
    marker = f"audit-{uuid.uuid4().hex[:8]}"
    assert post(srv, "/v1/models", "not-a-key", {}).status_code == 401
    r = post(srv, "/v1/completions", "acme1", {"model": "tiny", "prompt": marker, "max_tokens": 3})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in srv.audit.read_text().splitlines()]
        mine = [rec for rec in lines if marker in json.dumps(rec)]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (rec,) = mine
    usage = r.json()["usage"]
    assert rec["tenant"] == "acme" and rec["key_id"] == split_key(srv.keys["acme1"])[0] and rec["role"] == "basic"
    assert rec["model"] == "tiny" and rec["status"] == 200 and rec["path"] == "/v1/completions"
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert rec["prompts"] == [marker] or marker in rec["prompts"][0]
    assert rec["outputs"] == [r.json()["choices"][0]["text"]]
    refused = [x for x in lines if x["status"] in (401, 403, 429)]
    assert refused and all(x["completion_tokens"] == 0 for x in refused)


# -- abuse --------------------------------------------------------------------------------------------
def test_model_names_that_are_paths_are_never_opened(srv, tiny_llama):
    fifo = srv.root / "model.fifo"
    os.mkfifo(fifo)  # opening it to read would block: a request that did so would not answer
    names = [str(fifo), str(tiny_llama), "../../../../etc/passwd", "file:///etc/passwd", "~/.ssh/id_rsa",
             f"{fifo}:latest"]
    for name in names:
        rs = [post(srv, "/v1/completions", "ops", {"model": name, "prompt": "Hi", "max_tokens": 1}, timeout=5),
              post(srv, "/v1/chat/completions", "ops", {"model": name, "messages": [{"role": "user", "content": "x"}]},
                   timeout=5),
              post(srv, "/tokenize", "ops", {"model": name, "prompt": "Hi"}, timeout=5),
              post(srv, "/api/generate", "ops", {"model": name, "prompt": "Hi", "stream": False}, timeout=5),
              post(srv, "/api/show", "ops", {"model": name}, timeout=5),
              post(srv, "/api/chat", "acme1", {"model": name, "messages": []}, timeout=5)]
        assert all(r.status_code in (400, 404) for r in rs), (name, [(r.status_code, r.text[:100]) for r in rs])


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes `sock`, sending it a byte of `trickle` every 0.2 s
    meanwhile (none: silent); None if it is still open after `seconds`."""
    start = time.monotonic()
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() - start < seconds:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent:sent + 1])
                sent += 1
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    return None


def test_slow_clients_are_cut_off(srv):
    host, port = srv.base.removeprefix("http://").split(":")
    key = srv.keys["beta"]

    def trickled_head() -> float | None:
        with socket.create_connection((host, int(port))) as s:
            return _closed_within(s, 4 * READ_TIMEOUT, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200)

    def silent() -> float | None:
        with socket.create_connection((host, int(port))) as s:
            return _closed_within(s, 4 * READ_TIMEOUT)

    def slow_body() -> bytes:
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ".encode())
            s.settimeout(4 * READ_TIMEOUT)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return data

    with ThreadPoolExecutor(3) as pool:
        head, idle, body = pool.submit(trickled_head), pool.submit(silent), pool.submit(slow_body)
        head, idle, body = head.result(), idle.result(), body.result()
    assert head is not None and READ_TIMEOUT * 0.9 <= head <= READ_TIMEOUT + 2, head
    assert idle is not None and READ_TIMEOUT * 0.9 <= idle <= READ_TIMEOUT + 2, idle
    assert body.startswith(b"HTTP/1.1 408") and b"request_timeout" in body, body[:300]
    assert httpx.get(f"{srv.base}/health").status_code == 200
    # An ordinary keep-alive client is not cut off between its requests.
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}) as c:
        for _ in range(3):
            assert c.get(f"{srv.base}/v1/models").status_code == 200


# -- gRPC -------------------------------------------------------------------------------------------
def test_grpc_uses_the_same_keys_and_roles(srv):
    from pagoda.client import EngineClient

    with EngineClient(srv.grpc, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.list_models()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with EngineClient(srv.grpc, api_key=srv.keys["acme1"], timeout=30) as c:
        assert c.list_models() == ["tiny"]
        # allowed: two tokens come back (their text may be empty: a random model's sampled tokens)
        pieces = list(c.generate("Hi", model="tiny", max_tokens=2, ignore_eos=True))
        assert sum(len(p.token_ids) for p in pieces) == 2 and pieces[-1].finish_reason == "length"
        with pytest.raises(grpc.RpcError) as e:
            c.complete("Hi", model="tiny-pro", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with EngineClient(srv.grpc, api_key=srv.keys["beta"], timeout=30) as c:
        assert c.list_models() == ["tiny", "tiny-pro"]


# -- reload -----------------------------------------------------------------------------------------
def test_sighup_reloads_without_dropping_requests(srv):
    good = srv.config.read_text()
    stream_text: list[str] = []

    def stream() -> tuple[str | None, int]:  # 2000 tokens: seconds, well past the reload
        finish, tokens = None, 0
        for chunk in sdk(srv, "beta").completions.create(model="tiny", prompt="Hi", max_tokens=2000, stream=True,
                                                         stream_options={"include_usage": True},
                                                         extra_body={"ignore_eos": True}):
            if chunk.choices:
                stream_text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream)
        while not stream_text:
            time.sleep(0.01)
        new_key = add_key(srv.config, "newco", "basic")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert pagoda_main(["keys", "revoke", str(srv.config), split_key(srv.keys["gone"])[0]]) == 0
        assert sdk(srv, "gone").models.list()  # not reloaded yet
        os.kill(srv.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while post(srv, "/v1/completions", new_key, {"prompt": "Hi", "max_tokens": 1}).status_code != 200:
            assert time.monotonic() < deadline, "the new key did not start working"
            time.sleep(0.05)
        with pytest.raises(openai.AuthenticationError):
            sdk(srv, "gone").models.list()
        assert running.result(timeout=120) == ("length", 2000)  # the stream in flight went on to its end

    # A broken file is not taken: the config in force stays.
    srv.config.write_text("roles: [broken")
    os.kill(srv.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while not any("not reloaded" in line for line in srv.log):
        assert time.monotonic() < deadline, "".join(srv.log[-20:])
        time.sleep(0.05)
    assert post(srv, "/v1/completions", new_key, {"prompt": "Hi", "max_tokens": 1}).status_code == 200
    srv.config.write_text(good)


# -- fuzz ---------------------------------------------------------------------------------------------
def test_fuzz_with_a_key_and_every_route_without_one(srv):
    """schemathesis over every route with a key (one case per route and mode here: its cost is
    per route, ~0.3 s; `tools/fuzz_server.py --url URL --api-key KEY --cases 1000` is the long
    run), then every route of /openapi.json without a key (401, never parsed); no 5xx, and
    nothing left running or holding a KV block."""
    report = fuzz_server.fuzz_schema(srv.base, 1, seed=15, headers={"Authorization": f"Bearer {srv.keys['beta']}"})
    print("\n".join(report.lines()))
    assert not report.failures, "\n".join(report.lines())
    assert sum(c[200] for c in report.statuses.values()) > 0
    spec = srv.http.get(f"{srv.base}/openapi.json").json()
    open_paths = {"/health", "/metrics", "/version"}
    for path, operations in spec["paths"].items():
        for method in operations:
            for body in (None, {"model": "tiny", "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}):
                r = srv.http.request(method.upper(), srv.base + path.replace("{session_id}", "s1"), json=body)
                assert r.status_code < 500 and (path in open_paths or r.status_code == 401), (method, path, r.text)
    metrics = wait_idle(srv.base, timeout=30)
    assert {name: metrics.get(name, 0.0) for name in IDLE_METRICS} == {name: 0 for name in IDLE_METRICS}
    assert srv.http.get(f"{srv.base}/health").status_code == 200
    assert not any("Traceback" in line for line in srv.log), "".join(srv.log)[-3000:]
