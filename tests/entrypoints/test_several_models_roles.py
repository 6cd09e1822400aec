"""Roles on a server of several models, and the model store's uploads (issue 41), against one
real `pagoda serve --auth-config` of two tiny models on 127.0.0.1 whose memory budget holds one.

The keys: `limited` (its role's glob `tiny*` excludes `qwen`), two tenants under a role that
may use both, an admin, and a tenant with a budget of 1 token a minute. A refused request
changes nothing: the front checks the role before it loads, evicts or unloads a model
(`keep_alive: 0` included), with the answer a server of one model gives (403
`model_not_allowed`), and the tenant's limits (429) before it loads one. `/api/blobs` is the admin's: refused
before a byte is written; an upload over `--max-blob-size` is a 413 that leaves no file; a blob
no manifest names is deleted once older than `--blob-grace`, one a model uses stays."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from gguf_export import export_gguf
from server_process import start_server, stop_process

from pagoda.security.auth import new_key, write_file

ROLES = {
    "limited": {"models": ["tiny*"]},
    "user": {"models": ["*"]},
    "admin": {"models": ["*"], "admin": True},
    "metered": {"models": ["*"], "tokens_per_minute": 1},
}
KEYS = {"limited": ("lim", "limited"), "alice": ("a", "user"), "bob": ("b", "user"), "ops": ("ops", "admin"),
        "carol": ("c", "metered")}
MAX_BLOB_GIB = 0.001  # --max-blob-size: 1,073,741 bytes
MAX_BLOB_BYTES = int(MAX_BLOB_GIB * (1 << 30))
LEFT_OVER = b"an upload no create ever named"


@pytest.fixture(scope="module")
def srv(tiny_llama, tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("roles")
    home = root / "home"  # the server's own store; kernels and conversions are the suite's
    suite_home = Path(os.environ["PAGODA_HOME"])
    for name in ("kernels", "models", "converted"):
        (suite_home / name).mkdir(parents=True, exist_ok=True)
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to((suite_home / name).resolve(), target_is_directory=True)
    keys, entries = {}, []
    for name, (tenant, role) in KEYS.items():
        key_id, keys[name], digest = new_key()
        entries.append({"id": key_id, "tenant": tenant, "role": role, "hash": digest})
    config = root / "auth.yaml"
    write_file(config, {"roles": ROLES, "keys": entries})
    models = root / "models.yaml"
    models.write_text(f"models:\n  - model: {tiny_llama}\n    served_model_name: tiny\n"
                      f"  - model: {tiny_model_dirs['qwen2']}\n    served_model_name: qwen\n")
    blobs = home / "store" / "blobs"
    blobs.mkdir(parents=True)  # left by an earlier run: the server's start (seconds) is past its grace
    (blobs / digest_of(LEFT_OVER).replace(":", "-")).write_bytes(LEFT_OVER)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_HOME", str(home))
        proc, base = start_server(None, "--models-file", str(models), "--models-memory", "0.03",
                                  "--keep-alive", "-1", "--auth-config", str(config),
                                  "--max-blob-size", str(MAX_BLOB_GIB), "--blob-grace", "1", name=None)
    with httpx.Client(base_url=base, timeout=120) as http:
        yield SimpleNamespace(base=base, keys=keys, http=http, blobs=blobs, root=root)
    stop_process(proc)


def _auth(srv, key: str) -> dict:
    return {"Authorization": f"Bearer {srv.keys[key]}"}


def post(srv, path: str, key: str, body: dict) -> httpx.Response:
    return srv.http.post(path, json=body, headers=_auth(srv, key))


def loaded(srv) -> list[str]:
    """The loaded models, as the admin sees them (another key's /api/ps lists only its own)."""
    return sorted(m["name"] for m in srv.http.get("/api/ps", headers=_auth(srv, "ops")).json()["models"])


def metric(srv, name: str, **labels) -> float:
    total = 0.0
    for line in srv.http.get("/metrics").text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def load(srv, model: str) -> None:
    r = post(srv, "/api/generate", "ops", {"model": model, "prompt": "Hi", "stream": False,
                                            "options": {"num_predict": 1}})
    assert r.status_code == 200, r.text
    assert loaded(srv) == [model]


def swaps(srv) -> tuple[float, float]:
    return (sum(metric(srv, "pagoda:model_loads_total", model_name=m) for m in ("tiny", "qwen")),
            sum(metric(srv, "pagoda:model_unloads_total", model_name=m) for m in ("tiny", "qwen")))


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_unused_blobs_are_pruned_at_start_up(srv):
    assert not (srv.blobs / digest_of(LEFT_OVER).replace(":", "-")).exists()


# -- roles before the pool ------------------------------------------------------------------------
def test_a_refused_keep_alive_0_leaves_the_model_loaded(srv):
    load(srv, "qwen")
    before = swaps(srv)
    for path, body in (("/api/generate", {"model": "qwen", "keep_alive": 0}),
                       ("/api/chat", {"model": "qwen:latest", "messages": [], "keep_alive": 0})):
        r = post(srv, path, "limited", body)
        assert r.status_code == 403, r.text
        assert set(r.json()) == {"error"} and "may not use the model `qwen`" in r.json()["error"]
    assert loaded(srv) == ["qwen"] and swaps(srv) == before
    r = post(srv, "/api/generate", "alice", {"model": "qwen", "keep_alive": 0})  # a role that may: it unloads
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    assert loaded(srv) == []


def test_a_refused_request_neither_loads_nor_evicts(srv):
    load(srv, "tiny")
    before = swaps(srv)
    openai_calls = [("/v1/completions", {"model": "qwen", "prompt": "Hi", "max_tokens": 1}),
                    ("/v1/chat/completions", {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}]}),
                    ("/tokenize", {"model": "qwen", "prompt": "Hi"}),
                    ("/v1/sessions", {"model": "qwen"})]
    for path, body in openai_calls:  # the OpenAI shape, as a server of one model answers
        r = post(srv, path, "limited", body)
        assert r.status_code == 403, (path, r.text)
        error = r.json()["error"]
        assert error["code"] == "model_not_allowed" and error["param"] == "model", (path, error)
    for path, body in (("/api/generate", {"model": "qwen", "prompt": "Hi", "stream": False}),
                       ("/api/chat", {"model": "qwen", "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/api/show", {"model": "qwen"})):
        r = post(srv, path, "limited", body)
        assert r.status_code == 403 and set(r.json()) == {"error"}, (path, r.text)
    assert loaded(srv) == ["tiny"] and swaps(srv) == before
    # A name no model has: 404 naming only what the key may use, and nothing loads either.
    r = post(srv, "/v1/completions", "limited", {"model": "nope", "prompt": "Hi"})
    assert r.status_code == 404 and "`tiny`" in r.json()["error"]["message"] and "qwen" not in r.text
    # The tenants' role may use both: a request for qwen swaps the models, as it should.
    r = post(srv, "/v1/completions", "bob", {"model": "qwen", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert loaded(srv) == ["qwen"]


def test_a_tenant_over_its_limit_loads_nothing(srv):
    load(srv, "tiny")
    r = post(srv, "/v1/completions", "carol", {"model": "tiny", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text  # its tokens fill the minute's budget of 1
    before = swaps(srv)
    for model in ("qwen", "tiny"):  # not loaded: refused in the front; loaded: by the model's app, alike
        r = post(srv, "/v1/completions", "carol", {"model": model, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "token_limit_exceeded", (model, r.text)
        assert int(r.headers["retry-after"]) >= 1
    assert loaded(srv) == ["tiny"] and swaps(srv) == before


# -- the store's routes ---------------------------------------------------------------------------
def blob_files(srv) -> list[str]:
    return sorted(p.name for p in srv.blobs.iterdir()) if srv.blobs.is_dir() else []


def upload(srv, key: str, data, digest: str) -> httpx.Response:
    return srv.http.post(f"/api/blobs/{digest}", content=data, headers=_auth(srv, key))


def has_blob(srv, digest: str) -> int:
    return srv.http.head(f"/api/blobs/{digest}", headers=_auth(srv, "ops")).status_code


@pytest.mark.parametrize("key", ["limited", "alice"])
def test_blobs_are_the_admins(srv, key):
    data = os.urandom(64 << 10)
    digest = digest_of(data)
    files = blob_files(srv)
    r = upload(srv, key, data, digest)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required", r.text
    assert srv.http.head(f"/api/blobs/{digest}", headers=_auth(srv, key)).status_code == 403
    assert blob_files(srv) == files and has_blob(srv, digest) == 404
    assert upload(srv, "ops", data, digest).status_code == 201 and has_blob(srv, digest) == 200


@pytest.mark.parametrize("key", ["limited", "alice"])
@pytest.mark.parametrize("path, body", [
    ("/api/create", {"model": "made", "from": "tiny"}), ("/api/pull", {"model": "x"}),
    ("/api/push", {"model": "x"}), ("/api/copy", {"source": "tiny", "destination": "copied"}),
])
def test_store_writes_are_the_admins(srv, key, path, body):
    files = blob_files(srv)
    r = post(srv, path, key, body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required", r.text
    r = srv.http.request("DELETE", "/api/delete", json={"model": "made"}, headers=_auth(srv, key))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required", r.text
    assert blob_files(srv) == files


def test_an_upload_over_the_budget_is_413_and_leaves_nothing(srv):
    data = os.urandom(MAX_BLOB_BYTES + 1)
    digest = digest_of(data)

    def chunks():  # no Content-Length: refused as the bytes pass the budget
        for i in range(0, len(data), 64 << 10):
            yield data[i:i + (64 << 10)]

    for body in (data, chunks()):
        r = upload(srv, "ops", body, digest)
        assert r.status_code == 413, r.text
        assert f"--max-blob-size ({MAX_BLOB_BYTES} bytes)" in r.json()["error"]
    assert has_blob(srv, digest) == 404
    assert not [name for name in blob_files(srv) if name.startswith(".tmp-")]
    fits = data[:MAX_BLOB_BYTES]
    assert upload(srv, "ops", fits, digest_of(fits)).status_code == 201


def test_unreferenced_blobs_are_pruned_and_used_ones_stay(srv, tiny_llama):
    gguf = export_gguf(tiny_llama, srv.root / "tiny.gguf", "Q8_0")
    r = post(srv, "/api/create", "ops", {"model": "kept", "from": str(gguf), "stream": False})
    assert r.status_code == 200, r.text
    manifest = json.loads((srv.blobs.parent / "manifests/registry.ollama.ai/library/kept/latest").read_text())
    used = [layer["digest"].replace(":", "-") for layer in [manifest["config"], *manifest["layers"]]]
    orphan = os.urandom(1000)
    assert upload(srv, "ops", orphan, digest_of(orphan)).status_code == 201
    trigger = b"each upload prunes what is older than --blob-grace"
    orphan_file = srv.blobs / digest_of(orphan).replace(":", "-")
    deadline = time.monotonic() + 30
    while orphan_file.exists():  # (not HEAD: a HEAD that finds a blob restarts its grace)
        assert time.monotonic() < deadline, "the unreferenced blob was never pruned"
        assert upload(srv, "ops", trigger, digest_of(trigger)).status_code in (200, 201)
        time.sleep(0.2)
    assert has_blob(srv, digest_of(orphan)) == 404
    kept = blob_files(srv)
    assert all(name in kept for name in used), (used, kept)
    assert post(srv, "/api/show", "ops", {"model": "kept"}).status_code == 200
