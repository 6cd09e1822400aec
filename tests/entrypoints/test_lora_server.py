"""LoRA adapters through `pagoda serve` (vLLM's interface), with the official openai client: a
request's model picks an adapter, /v1/models lists adapters with their base as parent, adapters
load and unload at runtime (the admin role's), and a new version swaps in under traffic without a
failed request, the requests already running finishing on the version they started with."""

from __future__ import annotations

import contextlib
import io
import json
import threading

import httpx
import openai
import pytest

from pagoda.cli import main as pagoda_main
from tests.lora.adapters import make_peft_adapter, peft_greedy
from pagoda.client import EngineClient
from tests.server_process import _free_port, start_server, stop_process

MAX_TOKENS = 10
PROMPT = "Once upon a time there was a little engine"


def _add_key(path, tenant: str, role: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pagoda_main(["keys", "add", str(path), "--tenant", tenant, "--role", role]) == 0
    return out.getvalue().strip().splitlines()[-1]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    return {name: make_peft_adapter(tiny_llama, root / name, seed=seed) for name, seed in (("v1", 21), ("v2", 22))}


@pytest.fixture(scope="module")
def served(tiny_llama, adapters, tmp_path_factory):
    """(base URL, {role: key}) of a server in an engine process, with adapter `sql` (v1) loaded."""
    config = tmp_path_factory.mktemp("lora-auth") / "auth.yaml"
    config.write_text(json.dumps({"roles": {"user": {"models": ["*"]}, "ops": {"models": ["*"], "admin": True}}}))
    keys = {"admin": _add_key(config, "ops", "ops"), "user": _add_key(config, "acme", "user")}
    grpc_port = _free_port()
    proc, base = start_server(tiny_llama, "--engine-process", "--auth-config", str(config), "--enable-lora",
                              "--max-loras", "2", "--lora-modules", f"sql={adapters['v1']}",
                              "--grpc-port", str(grpc_port))
    keys["grpc"] = f"127.0.0.1:{grpc_port}"
    yield base, keys
    stop_process(proc)


@pytest.fixture(scope="module")
def references(tiny_llama, adapters, served):
    base, keys = served
    ids = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT}, timeout=30,
                     headers={"Authorization": f"Bearer {keys['user']}"}).json()["tokens"]
    texts = {}
    for name, path in (("base", None), ("v1", adapters["v1"]), ("v2", adapters["v2"])):
        tokens = peft_greedy(tiny_llama, path, [ids], MAX_TOKENS)[0]
        texts[name] = httpx.post(f"{base}/detokenize", json={"tokens": tokens}, timeout=30,
                                 headers={"Authorization": f"Bearer {keys['user']}"}).json()["prompt"]
    assert len(set(texts.values())) == 3  # each adapter changes the answer
    return texts


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


# greedy, every token kept as text: the reference's token ids, detokenized by the server, must match
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}}


def _complete(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert r.model == model
    return r.choices[0].text


def _admin_post(base: str, keys: dict, path: str, body: dict, role: str = "admin") -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {keys[role]}"}, timeout=60)


def test_model_names_pick_the_adapter(served, references):
    base, keys = served
    client = _client(base, keys["user"])
    cards = {m.id: m for m in client.models.list().data}
    assert cards["sql"].parent == "tiny" and cards["tiny"].parent is None
    got = _complete(client, "sql")
    assert got == references["v1"], (got == references["base"], got == references["v2"])
    assert _complete(client, "tiny") == references["base"]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "sql"
    with pytest.raises(openai.NotFoundError, match="`sql`"):  # the 404 lists the adapters too
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_grpc_and_ollama_pick_the_adapter_by_name(served, references):
    base, keys = served
    client = _client(base, keys["user"])
    http = {name: client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text for name in ("sql", "tiny")}
    assert http["sql"] != http["tiny"]
    with EngineClient(keys["grpc"], api_key=keys["user"], timeout=60) as grpc_client:
        assert grpc_client.list_models() == ["tiny", "sql"]
        for name in ("sql", "tiny"):
            assert grpc_client.complete(PROMPT, model=name, max_tokens=MAX_TOKENS, temperature=0,
                                        ignore_eos=True) == http[name]
    ollama_answer = httpx.post(f"{base}/api/generate", headers={"Authorization": f"Bearer {keys['user']}"}, timeout=60,
                               json={"model": "sql", "prompt": PROMPT, "raw": True, "stream": False,
                                     "options": {"temperature": 0, "num_predict": MAX_TOKENS}})
    assert ollama_answer.status_code == 200, ollama_answer.text
    answer = ollama_answer.json()["response"]
    assert answer and http["sql"].startswith(answer)  # (Ollama's generate stops at an eos)


def test_load_and_unload_at_runtime(served, adapters, references):
    base, keys = served
    client = _client(base, keys["user"])
    body = {"lora_name": "extra", "lora_path": str(adapters["v2"])}
    denied = _admin_post(base, keys, "/v1/load_lora_adapter", body, role="user")
    assert denied.status_code == 403 and "LoRA" in denied.json()["error"]["message"]
    assert _admin_post(base, keys, "/v1/load_lora_adapter", body).status_code == 200
    assert _complete(client, "extra") == references["v2"]
    again = _admin_post(base, keys, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = _admin_post(base, keys, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(base)})
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
    assert _admin_post(base, keys, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "extra")
    assert _admin_post(base, keys, "/v1/unload_lora_adapter", {"lora_name": "extra"}).status_code == 404
    assert _complete(client, "tiny") == references["base"]  # the server serves everyone else throughout


def test_swap_under_traffic(served, adapters, references):
    """A stream started on v1 finishes on v1 after the swap; requests sent during the swap all
    succeed on one version or the other; after it, every request gets v2."""
    base, keys = served
    client = _client(base, keys["user"])
    stream = client.completions.create(model="sql", prompt=PROMPT, stream=True, **GREEDY)
    first = next(iter(stream))
    results, errors = [], []

    def traffic():
        try:
            results.extend(_complete(client, "sql") for _ in range(4))
        except Exception as exc:  # noqa: BLE001 - counted below
            errors.append(exc)

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    swap = _admin_post(base, keys, "/v1/load_lora_adapter",
                       {"lora_name": "sql", "lora_path": str(adapters["v2"]), "load_inplace": True})
    assert swap.status_code == 200
    for t in threads:
        t.join()
    streamed = first.choices[0].text + "".join(c.choices[0].text for c in stream)
    assert streamed == references["v1"]
    assert not errors and len(results) == 8
    assert all(r in (references["v1"], references["v2"]) for r in results)
    assert _complete(client, "sql") == references["v2"]
    _admin_post(base, keys, "/v1/load_lora_adapter",
                {"lora_name": "sql", "lora_path": str(adapters["v1"]), "load_inplace": True})
