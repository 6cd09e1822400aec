"""Several models in one server (pagoda/entrypoints/model_pool.py, model_dispatch.py): requests
route by `model`, models load on first use, unload after keep_alive or to make room (LRU), a
request waits for a busy model instead of failing, and metrics carry each model's label.

One real server serves the tiny Llama (with a 16k context, as `long`) and the tiny Qwen2 within
a memory budget that holds one of them (--models-memory 0.03 GiB; each is ~0.5 MB of weights +
0.02 GiB of KV cache). The pool's count limit and its bounded wait run in-process on the same
tiny models, through the server's own load function."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from types import SimpleNamespace

import httpx
import ollama
import openai
import pytest

from tests.server_process import start_server, stop_process


@pytest.fixture(scope="module")
def server(long_tiny_llama, tiny_model_dirs, tmp_path_factory):
    models_file = tmp_path_factory.mktemp("models") / "models.yaml"
    models_file.write_text(f"models:\n"
                           f"  - model: {long_tiny_llama}\n    served_model_name: long\n    max_model_len: 16384\n"
                           f"  - model: {tiny_model_dirs['qwen2']}\n    served_model_name: qwen\n")
    proc, base = start_server(None, "--models-file", str(models_file), "--models-memory", "0.03",
                              "--keep-alive", "-1", name=None)
    yield base
    stop_process(proc)


def _metric(base: str, name: str, **labels) -> float:
    text = httpx.get(f"{base}/metrics").text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _loaded(base: str) -> list[str]:
    return sorted(m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"])


def _complete(base: str, model: str, prompt: str = "Hello there", **kw) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_are_listed_before_they_load(server):
    models = httpx.get(f"{server}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["long", "qwen"]
    tags = [m["name"] for m in httpx.get(f"{server}/api/tags").json()["models"]]
    assert tags[:2] == ["long", "qwen"]


def test_requests_route_by_model_with_each_models_own_output(server, long_tiny_llama, tiny_model_dirs):
    from pagoda import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    for name, path, context in [("qwen", tiny_model_dirs["qwen2"], None), ("long", long_tiny_llama, 16384)]:
        served = _complete(server, name)
        assert served["model"] == name
        llm = LLM(model=str(path), dtype="float32", kv_cache_memory=0.02, max_model_len=context)
        expected = llm.generate(["Hello there"], params)[0].outputs[0].token_ids
        assert served["choices"][0]["text"] == llm.get_tokenizer().decode(expected)
        del llm
    # the budget holds one model: loading `long` unloaded `qwen`, the least recently used
    assert _loaded(server) == ["long"]
    assert _metric(server, "pagoda:model_unloads_total", model_name="qwen", reason="memory") >= 1
    assert _metric(server, "pagoda:model_loaded", model_name="long") == 1
    assert _metric(server, "pagoda:model_loaded", model_name="qwen") == 0
    # each model's series carries its label on the one /metrics page
    assert _metric(server, "pagoda:generation_tokens_total", model_name="qwen") >= 8
    assert _metric(server, "pagoda:generation_tokens_total", model_name="long") >= 8


def test_requests_for_a_loading_model_share_one_load(server):
    _complete(server, "qwen")  # qwen loaded, long unloaded
    loads_before = _metric(server, "pagoda:model_loads_total", model_name="long")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    results: list[str] = []

    def ask() -> None:
        out = client.completions.create(model="long", prompt="Count: one two", max_tokens=4, temperature=0)
        results.append(out.choices[0].text)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert _metric(server, "pagoda:model_loads_total", model_name="long") == loads_before + 1


def test_a_busy_model_is_not_unloaded_the_other_request_waits(server):
    """A long stream on `long` holds the only room; a request for `qwen` waits for it to end,
    then `long` is unloaded and `qwen` loads: nothing fails."""
    _complete(server, "long")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    stream = client.completions.create(model="long", prompt="Once upon a time", max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))  # the stream is in flight on the server
    assert first.choices[0].text is not None
    done: dict[str, float] = {}

    def ask_qwen() -> None:
        _complete(server, "qwen")
        done["qwen"] = time.monotonic()

    waiter = threading.Thread(target=ask_qwen)
    waiter.start()
    pieces = sum(1 for _ in stream)
    done["long"] = time.monotonic()
    waiter.join(timeout=120)
    assert pieces > 100
    assert done["qwen"] > done["long"]
    assert _loaded(server) == ["qwen"]


def test_ollama_keep_alive_unloads(server):
    client = ollama.Client(host=server)
    client.generate(model="qwen", prompt="Hi", options={"num_predict": 2})
    assert "qwen" in _loaded(server)
    ps = client.ps()
    assert [m.model for m in ps.models] == ["qwen"]
    out = client.generate(model="qwen", prompt="", keep_alive=0)  # Ollama's "unload now"
    assert out.done_reason == "unload"
    assert _loaded(server) == []
    # a request's keep_alive: the model stays that long after it, then unloads by itself
    client.chat(model="qwen:latest", messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 2},
                keep_alive="1s")
    assert _loaded(server) == ["qwen"]
    expires = client.ps().models[0].expires_at
    assert expires is not None and expires.year < 2300
    deadline = time.monotonic() + 30
    while _loaded(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _loaded(server) == []
    assert _metric(server, "pagoda:model_unloads_total", model_name="qwen", reason="keep_alive") == 1


def test_bad_model_names(server):
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert r.status_code == 404 and "`long`, `qwen`" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and "`model` is required" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/api/chat", content=b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]
    r = httpx.post(f"{server}/api/generate", json={"model": "qwen", "prompt": "hi", "keep_alive": "soon"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server).generate(model="nope", prompt="hi")
    assert e.value.status_code == 404


def test_sessions_follow_their_model(server):
    r = httpx.post(f"{server}/v1/sessions", json={"model": "qwen", "system": "Be brief."})
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    r = httpx.post(f"{server}/v1/sessions/{sid}/messages", json={"content": "Hi", "max_tokens": 4,
                                                                 "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server}/v1/sessions/{sid}").json()["model"] == "qwen"
    assert httpx.delete(f"{server}/v1/sessions/{sid}").status_code == 200
    assert httpx.get(f"{server}/v1/sessions/{sid}").status_code == 404


def test_pages_and_each_models_debug_data(server):
    assert "<textarea" in httpx.get(f"{server}/").text
    for name in ("qwen", "long"):
        r = httpx.get(f"{server}/v1/debug/engine", params={"model": name}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == name
    assert httpx.get(f"{server}/v1/debug/engine").json()["model"] == "long"  # the model used last
    assert httpx.get(f"{server}/v1/debug/engine", params={"model": "nope"}).status_code == 404


# -- the pool in-process: count limit, LRU order, the bounded wait, a model too large ---------------
def _pool(tmp_dirs: dict, names: list[str], **settings):
    from pagoda.config import create_engine_config
    from pagoda.engine_args import EngineArgs
    from pagoda.entrypoints.model_pool import ModelPool
    from pagoda.entrypoints.served_models import ModelSpec
    from pagoda.entrypoints.openai.api_server import _model_app
    from pagoda.entrypoints.prometheus import MetricFamilies

    families = MetricFamilies()
    specs = []
    for name in names:
        args = SimpleNamespace(**{f: getattr(EngineArgs(), f) for f in vars(EngineArgs())})
        args.model, args.dtype, args.kv_cache_memory = str(tmp_dirs[name.split("-")[0]]), "float32", 0.02
        args.engine_process, args.max_engine_restarts, args.max_queue_len = False, 0, None
        args.request_timeout, args.session_ttl, args.max_sessions = None, 60.0, 10
        args.state_dir, args.max_stored_responses, args.batch_concurrency, args.port = "none", 100, None, 0
        args.reasoning_parser, args.tool_call_parser = None, None
        spec = ModelSpec(names=[name], args=args, keep_alive=None)
        spec.config = create_engine_config(EngineArgs(**{k: v for k, v in vars(args).items() if k in vars(EngineArgs())}))
        specs.append(spec)
    return ModelPool(specs, load=lambda s: _model_app(s.args, s.config, s.names, None, families), **settings)


def test_pool_unloads_least_recently_used_and_bounds_the_wait(tiny_model_dirs):
    from pagoda.entrypoints.openai.errors import OpenAIError

    pool = _pool(tiny_model_dirs, ["llama", "qwen2", "llama-2"], memory_budget=1 << 30, max_loaded=2,
                 load_timeout=0.5)

    async def scenario() -> None:
        llama, qwen, llama2 = pool.specs
        for spec in (llama, qwen):
            pool.release(await pool.acquire(spec))
        pool.release(await pool.acquire(llama))  # llama used last: qwen is the least recently used
        pool.release(await pool.acquire(llama2))
        assert sorted(pool.loaded) == ["llama", "llama-2"]
        busy = [await pool.acquire(llama), await pool.acquire(llama2)]  # both in flight: no room
        with pytest.raises(OpenAIError) as e:
            await pool.acquire(qwen)
        assert e.value.status == 503 and e.value.code == "models_busy"
        waiting = asyncio.create_task(pool.acquire(qwen))  # waits ...
        await asyncio.sleep(0)
        assert not waiting.done()
        pool.release(busy[0])  # ... until one is idle, then takes its room
        model = await asyncio.wait_for(waiting, 30)
        assert sorted(pool.loaded) == ["llama-2", "qwen2"] and model.spec is qwen
        pool.release(model)
        pool.release(busy[1])
        await pool.close()
        pool.shutdown()

    asyncio.run(scenario())


def test_a_keep_alive_of_zero_unloads_after_the_request_not_before(tiny_model_dirs):
    pool = _pool(tiny_model_dirs, ["llama"], memory_budget=1 << 30, max_loaded=2, load_timeout=30)
    spec = pool.specs[0]
    spec.keep_alive = 0.0

    async def scenario() -> None:
        model = await pool.acquire(spec)  # loads it; the request holds it
        for _ in range(20):  # the loop runs whatever the load scheduled: nothing unloads a model in use
            await asyncio.sleep(0)
        assert pool.loaded.get("llama") is model and model.app is not None
        pool.release(model)
        for _ in range(200):
            if not pool.loaded:
                break
            await asyncio.sleep(0.01)
        assert not pool.loaded  # the release's keep_alive of 0 unloaded it
        pool.shutdown()

    asyncio.run(scenario())


def test_pool_refuses_a_model_larger_than_the_budget(tiny_model_dirs):
    from pagoda.entrypoints.openai.errors import OpenAIError

    pool = _pool(tiny_model_dirs, ["llama"], memory_budget=10 << 20, max_loaded=2, load_timeout=5)

    async def scenario() -> None:
        with pytest.raises(OpenAIError) as e:
            await pool.acquire(pool.specs[0])
        assert e.value.code == "insufficient_memory" and "--models-memory" in e.value.message

    asyncio.run(scenario())
    assert not pool.loaded


def test_models_file_errors_name_the_problem(tmp_path):
    from pagoda.entrypoints.served_models import read_models_file

    bad = tmp_path / "models.yaml"
    bad.write_text("models:\n  - model: a\n  - model: b\n    max-num-seqs: 4\n    colour: red\n")
    with pytest.raises(ValueError, match=r"model 2: unknown key\(s\) colour"):
        read_models_file(str(bad))
    bad.write_text("models:\n  - name: a\n")
    with pytest.raises(ValueError, match="model 1: expected a mapping with `model: NAME`"):
        read_models_file(str(bad))
    good = tmp_path / "good.yaml"
    good.write_text("models:\n  - a\n  - model: b\n    served_model_name: bee\n    keep_alive: 10m\n")
    assert read_models_file(str(good)) == [{"model": "a"},
                                           {"model": "b", "served_model_name": ["bee"], "keep_alive": "10m"}]


def test_keep_alive_durations():
    from pagoda.entrypoints.served_models import parse_keep_alive

    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive(0) == 0
    assert parse_keep_alive("-1") is None and parse_keep_alive(-1) is None and parse_keep_alive("2.5s") == 2.5
    for bad in ("soon", "5 m", "", True, [1]):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)


@pytest.mark.parametrize("argv, message", [
    (["--model", "a", "--model", "b", "--served-model-name", "x"], "give one name per --model (2 models, 1 names)"),
    (["--model", "a", "--model", "b", "--data-parallel-size", "2"], "--data-parallel-size serves one model"),
    (["--model", "a", "--model", "b", "--grpc-port", "1"], "--grpc-port serves one model"),
    (["--model", "a", "--model", "/no/such/model"], "model '/no/such/model' not found"),
    (["--model", "a", "--model", "b", "--keep-alive", "soon"], "--keep-alive: keep_alive must be a duration"),
])
def test_serve_refuses_bad_model_options_before_listening(argv, message, capsys, tiny_llama):
    from pagoda.cli import main

    argv = [str(tiny_llama) if a == "a" else str(tiny_llama) if a == "b" and "/no/such/model" not in argv else a
            for a in argv]
    assert main(["serve", "--port", "1", *argv]) == 1
    assert message in capsys.readouterr().err
