"""Ollama's API (`/api/...`) on a real `pagoda serve` of the tiny model, through the official
`ollama` Python client, unmodified. The server gets its own `$PAGODA_HOME` (so its own, empty
model store; kernels and conversions linked from the suite's), where the store tests create,
copy and delete models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import ollama
import pytest
from gguf_export import export_gguf
from server_process import start_server, stop_process

MODEL = "tiny"
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    suite_home = Path(os.environ["PAGODA_HOME"])
    home = tmp_path_factory.mktemp("ollama-home")
    for name in ("kernels", "models", "converted"):
        (suite_home / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to((suite_home / name).resolve(), target_is_directory=True)
    return home


@pytest.fixture(scope="module")
def server(tiny_llama, home):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_HOME", str(home))
        proc, base = start_server(tiny_llama, name=MODEL)
    yield base
    stop_process(proc)


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    return export_gguf(tiny_llama, tmp_path_factory.mktemp("ollama-gguf") / "tiny.gguf", "Q8_0")


def _check_final(part, max_tokens: int) -> None:
    assert part.done is True and part.done_reason in ("stop", "length")
    assert part.model == MODEL and part.created_at.endswith("Z")
    assert 0 < part.eval_count <= max_tokens and part.prompt_eval_count > 0
    assert part.total_duration >= part.eval_duration > 0 and part.prompt_eval_duration > 0
    assert part.load_duration == 0


def test_generate_plain_and_streamed(client):
    plain = client.generate(model=MODEL, prompt=PROMPT, options=GREEDY)
    _check_final(plain, 12)
    assert plain.response and plain.context and len(plain.context) == plain.prompt_eval_count + plain.eval_count
    parts = list(client.generate(model=MODEL, prompt=PROMPT, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and len(parts) > 2
    _check_final(parts[-1], 12)
    assert "".join(p.response for p in parts) == plain.response
    assert parts[-1].context == plain.context


def test_raw_generate_equals_v1_completions(client, server):
    v1 = httpx.post(f"{server}/v1/completions",
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    raw = client.generate(model=f"{MODEL}:latest", prompt=PROMPT, raw=True, options=GREEDY)
    assert raw.response == v1["choices"][0]["text"]
    assert raw.prompt_eval_count == v1["usage"]["prompt_tokens"] and raw.eval_count == v1["usage"]["completion_tokens"]
    assert raw.context is None  # Ollama returns no context for raw prompts


def test_chat_plain_and_streamed_with_options(client, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    plain = client.chat(model=MODEL, messages=messages, options=GREEDY)
    _check_final(plain, 12)
    assert plain.message.role == "assistant" and plain.message.content
    v1 = httpx.post(f"{server}/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}).json()
    assert plain.message.content == v1["choices"][0]["message"]["content"]
    parts = list(client.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    _check_final(parts[-1], 12)
    assert "".join(p.message.content for p in parts) == plain.message.content
    # Sampling options: a seed makes a sampled answer repeatable; num_predict bounds it.
    sampled = {"temperature": 1.0, "top_k": 20, "top_p": 0.95, "min_p": 0.01, "seed": 7, "num_predict": 6,
               "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.1, "num_ctx": 2048}
    first = client.chat(model=MODEL, messages=messages, options=sampled)
    second = client.chat(model=MODEL, messages=messages, options=sampled)
    assert first.message.content == second.message.content and first.eval_count <= 6


def test_stop_option_cuts_the_answer(client):
    full = client.generate(model=MODEL, prompt=PROMPT, raw=True, options=GREEDY).response
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), full
    cut = client.generate(model=MODEL, prompt=PROMPT, raw=True, options={**GREEDY, "stop": [stop]})
    assert cut.done_reason == "stop" and cut.response == full[:full.index(stop)]


def test_format_json_and_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    out = client.generate(model=MODEL, prompt="A record:", format=schema, options={"temperature": 0, "num_predict": 32})
    value = json.loads(out.response)
    assert set(value) == {"n", "ok"} and isinstance(value["ok"], bool)
    chat = client.chat(model=MODEL, messages=[{"role": "user", "content": "JSON please"}], format="json",
                       options={"temperature": 0, "num_predict": 64})
    assert chat.done_reason == "stop"
    assert isinstance(json.loads(chat.message.content), dict)


def test_errors_are_ollama_shaped(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="nope", prompt="x")
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "x", "images": [b"\x89PNG"]}])
    assert e.value.status_code == 400 and "images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="x", options={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="x", format={"type": "nonsense"})
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="x", think=True)
    assert e.value.status_code == 400 and "think" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[{"type": "retrieval"}])
    assert e.value.status_code == 400 and "tools" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="x", logprobs=True, top_logprobs=21)
    assert e.value.status_code == 400 and "top_logprobs" in e.value.error
    r = httpx.post(f"{server}/api/generate", content=b"{not json")
    assert r.status_code == 400 and set(r.json()) == {"error"}
    # An empty prompt loads the model (Ollama's preload request); keep_alive is accepted.
    load = client.generate(model=MODEL, prompt="", keep_alive="5m")
    assert load.done and load.done_reason == "load" and load.response == ""


def test_tags_show_ps_version(client, server):
    listed = client.list()
    served = [m for m in listed.models if m.model == MODEL]
    assert len(served) == 1 and served[0].size > 0
    assert served[0].details.family == "llama" and served[0].details.format == "safetensors"
    assert served[0].details.quantization_level == "F32"
    shown = client.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["general.parameter_count"] > 0 and shown.modelinfo["llama.context_length"] > 0
    assert "im_start" in shown.template and shown.capabilities == ["completion"] and shown.modelfile
    running = client.ps()
    assert [m.model for m in running.models] == [MODEL] and running.models[0].context_length > 0
    assert running.models[0].expires_at.year > 2100
    assert httpx.get(f"{server}/api/version").json()["version"]


def test_store_create_show_copy_delete(client, tiny_gguf):
    done = client.create(model="made:v1", from_=str(tiny_gguf), system="You are terse.",
                         parameters={"temperature": 0.3, "stop": ["<|im_end|>"]})
    assert done.status == "success"
    names = {m.model for m in client.list().models}
    assert "made:v1" in names
    shown = client.show("made:v1")
    assert shown.details.format == "gguf" and shown.details.quantization_level == "Q8_0"
    assert "temperature" in shown.parameters and "FROM made:v1" in shown.modelfile
    assert shown.modelinfo["general.architecture"] == "llama"
    streamed = list(client.create(model="made:v2", from_="made:v1", template="{{ .Prompt }}", stream=True))
    assert streamed[-1].status == "success"
    assert client.copy("made:v1", "copied:latest").status == "success"
    tags = {m.model: m for m in client.list().models}
    assert tags["copied:latest"].digest == tags["made:v1"].digest
    for name in ("made:v1", "made:v2", "copied:latest"):
        assert client.delete(name).status == "success"
    assert not {"made:v1", "made:v2", "copied:latest"} & {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("made:v1")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.copy("never-made", "x")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:  # in the store or not, only the served model runs
        client.generate(model="made:v1", prompt="x")
    assert e.value.status_code == 404


def test_create_from_an_uploaded_blob(client, server, tiny_gguf, home):
    """`ollama create` with a local file: the client uploads the GGUF (/api/blobs), then names it."""
    digest = client.create_blob(tiny_gguf)
    assert httpx.head(f"{server}/api/blobs/{digest}", timeout=10).status_code == 200
    assert client.create(model="uploaded", files={"tiny.gguf": digest}, system="Be brief.").status == "success"
    shown = client.show("uploaded")
    assert shown.details.quantization_level == "Q8_0" and "Be brief." in shown.modelfile
    tags = {m.model: m for m in client.list().models}
    assert tags["uploaded:latest"].size > tiny_gguf.stat().st_size  # the weights and the system layer
    assert client.delete("uploaded").status == "success"
    wrong = "sha256:" + "0" * 64  # a body that does not hash to its digest is refused, and not kept
    answer = httpx.post(f"{server}/api/blobs/{wrong}", content=b"not the announced bytes", timeout=10)
    assert answer.status_code == 400 and "expected" in answer.json()["error"]
    assert httpx.head(f"{server}/api/blobs/{wrong}", timeout=10).status_code == 404
    assert not list((home / "store" / "blobs").glob(".tmp-*"))
    assert httpx.head(f"{server}/api/blobs/sha256:xyz", timeout=10).status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.create(model="nothing", files={"tiny.gguf": wrong})
    assert e.value.status_code == 400 and "upload it first" in str(e.value)


def test_pull_and_push_report_registry_errors(client):
    # Nothing listens on port 9: the failure comes back as Ollama does, an error line / status.
    with pytest.raises(ollama.ResponseError) as e:
        list(client.pull("http://127.0.0.1:9/library/none:latest", stream=True))
    assert e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.push("127.0.0.1:9/library/none:latest", insecure=True)
    assert e.value.status_code == 404


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """The CNCF distribution registry (Debian's `docker-registry`) on 127.0.0.1, as tests/store uses."""
    from pagoda.bench.registry_process import RegistryNotInstalled, start_registry

    try:
        reg = start_registry(tmp_path_factory.mktemp("ollama-registry"))
    except RegistryNotInstalled as e:
        pytest.skip(str(e))
    with reg:
        yield reg.host


def test_push_then_pull_through_a_registry(client, tiny_gguf, registry):
    remote = f"{registry}/library/tiny:v1"
    assert client.create(model="local:v1", from_=str(tiny_gguf)).status == "success"
    assert client.copy("local:v1", remote).status == "success"
    pushed = list(client.push(remote, insecure=True, stream=True))
    assert pushed[0].status == "retrieving manifest" and pushed[-1].status == "success"
    digest = {m.model: m.digest for m in client.list().models}[remote]
    assert client.delete(remote).status == "success" and client.delete("local:v1").status == "success"
    pulled = list(client.pull(remote, insecure=True, stream=True))
    assert pulled[0].status == "pulling manifest" and pulled[-1].status == "success"
    layers = [p for p in pulled if p.digest]
    assert layers and all(p.completed == p.total > 0 for p in layers)
    assert {m.model: m.digest for m in client.list().models}[remote] == digest
    assert client.pull(remote, insecure=True).status == "success"  # again, not streamed: nothing to fetch
    assert client.delete(remote).status == "success"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="module")
def long_client(long_tiny_llama):
    """The tiny model with room for the tools' system prompt (its own context is 256 tokens)."""
    proc, base = start_server(long_tiny_llama, "--max-model-len", "2048", name=MODEL)
    yield ollama.Client(host=base)
    stop_process(proc)


def test_chat_with_tools_and_a_tool_result(long_client):
    """Tools, an earlier call (Ollama's shape: arguments as an object) and the tool's answer all
    reach the prompt; the tiny model answers in text. (Parsing the model's calls: the next test,
    and tests/entrypoints/test_structured_server.py on the real model.)"""
    client = long_client
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat(model=MODEL, messages=ask, options=GREEDY)
    with_tools = client.chat(model=MODEL, messages=ask, tools=[WEATHER], options=GREEDY)
    assert with_tools.prompt_eval_count > plain.prompt_eval_count + 20
    history = ask + [{"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "content": '{"sky": "sunny"}', "tool_name": "get_weather"}]
    answered = client.chat(model=MODEL, messages=history, tools=[WEATHER], options=GREEDY)
    assert answered.prompt_eval_count > with_tools.prompt_eval_count + 10
    assert answered.message.role == "assistant" and not answered.message.tool_calls
    streamed = "".join(part.message.content for part in client.chat(
        model=MODEL, messages=history, tools=[WEATHER], options=GREEDY, stream=True))
    assert streamed == answered.message.content


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_tool_calls_in_the_models_text_become_ollamas_tool_calls(step):
    from pagoda.entrypoints.ollama.generation import _ChatReply
    from pagoda.entrypoints.openai.choice_parser import ChoiceParser
    from pagoda.entrypoints.openai.tool_calls import ToolChoice

    text = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    reply = _ChatReply(ChoiceParser(None, ToolChoice([WEATHER], None, True)))
    pieces = [reply(text[i:i + step], False) for i in range(0, len(text), step)] + [reply("", True)]
    messages = [p["message"] for p in pieces if p is not None]
    assert "".join(m["content"] for m in messages).strip() == "Let me look."
    calls = [c for m in messages for c in m.get("tool_calls", [])]
    assert calls == [{"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}]
    parsed = ollama.ChatResponse(model=MODEL, message={"role": "assistant", "content": "", "tool_calls": calls})
    assert parsed.message.tool_calls[0].function.arguments == {"city": "Paris"}


def test_logprobs(client):
    out = client.generate(model=MODEL, prompt=PROMPT, options=GREEDY, logprobs=True, top_logprobs=3)
    assert len(out.logprobs) == out.eval_count
    assert "".join(lp.token for lp in out.logprobs) == out.response
    for lp in out.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": PROMPT}], options=GREEDY,
                             logprobs=True, stream=True))
    tokens = [lp for part in parts for lp in (part.logprobs or [])]
    assert len(tokens) == parts[-1].eval_count and all(not lp.top_logprobs for lp in tokens)
    assert "".join(lp.token for lp in tokens) == "".join(part.message.content for part in parts)
    assert client.generate(model=MODEL, prompt=PROMPT, options=GREEDY).logprobs is None
