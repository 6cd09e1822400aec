"""The gRPC service beside HTTP, on one real `pagoda serve --grpc-port` of the tiny model, through
a real grpcio client (pagoda.client and the raw stubs): the same answers as HTTP, the same
validation with status codes, the API key in metadata, health and reflection, and a cancelled
call that frees its KV blocks."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from server_process import _free_port, start_server, stop_process

from pagoda.client import EngineClient
from pagoda.entrypoints.grpc_api import pagoda_pb2 as pb
from pagoda.entrypoints.grpc_api import pagoda_pb2_grpc as pb_grpc

KEY = "grpc-test-key"


@pytest.fixture(scope="module")
def server(long_tiny_llama):
    grpc_port = _free_port()
    proc, base = start_server(long_tiny_llama, "--grpc-port", str(grpc_port), "--api-key", KEY,
                              "--max-model-len", "16384", "--max-num-seqs", "2", "--max-queue-len", "0")
    yield base, f"127.0.0.1:{grpc_port}"
    stop_process(proc)


@pytest.fixture
def client(server):
    with EngineClient(server[1], api_key=KEY, timeout=60) as c:
        yield c


def _http(base: str, path: str, body: dict) -> dict:
    answer = httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_generate_streams_the_same_answer_as_http(server, client):
    base, _ = server
    want = _http(base, "/v1/completions", {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 24,
                                           "temperature": 0, "ignore_eos": True})
    pieces = list(client.generate("the quick brown fox", max_tokens=24, temperature=0, ignore_eos=True))
    assert "".join(p.text for p in pieces) == want["choices"][0]["text"]
    assert len(pieces) > 1 and sum(len(p.token_ids) for p in pieces) == 24
    last = pieces[-1]
    assert last.finish_reason == "length" and not any(p.finish_reason for p in pieces[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (want["usage"]["prompt_tokens"], 24)
    ids = client.tokenize("the quick brown fox", add_special_tokens=True)
    by_ids = client.complete(ids, max_tokens=24, temperature=0, ignore_eos=True)
    assert by_ids == want["choices"][0]["text"]


def test_chat_logprobs_tokenize_detokenize_and_models(server, client):
    base, _ = server
    messages = [{"role": "user", "content": "hello there"}]
    want = _http(base, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 12,
                                                "temperature": 0, "ignore_eos": True})
    pieces = list(client.chat(messages, max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))
    assert "".join(p.text for p in pieces) == want["choices"][0]["message"]["content"]
    logprobs = [lp for p in pieces for lp in p.logprobs]
    assert [lp.token_id for lp in logprobs] == [t for p in pieces for t in p.token_ids]
    assert all(len(lp.top_token_ids) == 2 and lp.logprob <= 0 for lp in logprobs)
    ids = client.tokenize("hello world")
    assert ids and client.detokenize(ids) == "hello world"
    assert client.list_models() == ["tiny"]
    chat_ids = client.stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatRequest(messages=[pb.ChatMessage(
        role="user", content="hello there")])), metadata=client.metadata).token_ids
    assert len(chat_ids) == pieces[-1].usage.prompt_tokens


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {  # enums: the random model's call ends
    "type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [1, 2, 3]}}, "required": ["a", "b"],
    "additionalProperties": False}}}]


def test_chat_with_tools_answers_the_calls_as_http_does(server, client):
    base, _ = server
    messages = [{"role": "user", "content": "add two and three"}]
    choice = {"type": "function", "function": {"name": "add"}}
    want = _http(base, "/v1/chat/completions", {"model": "tiny", "messages": messages, "tools": TOOLS,
                                                "tool_choice": choice, "max_tokens": 40, "temperature": 0})
    pieces = list(client.chat(messages, tools=TOOLS, tool_choice=choice, max_tokens=40, temperature=0))
    [http_call] = want["choices"][0]["message"]["tool_calls"]
    [call] = pieces[-1].tool_calls
    assert (call.name, call.arguments) == ("add", http_call["function"]["arguments"])
    assert pieces[-1].finish_reason == want["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(p.tool_calls for p in pieces[:-1])
    # the call and its result go back in the conversation, in the HTTP API's shape
    follow_up = messages + [{"role": "assistant", "content": "", "tool_calls": [http_call]},
                            {"role": "tool", "tool_call_id": http_call["id"], "content": "5"}]
    want = _http(base, "/v1/chat/completions", {"model": "tiny", "messages": follow_up, "tools": TOOLS,
                                                "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    pieces = list(client.chat(follow_up, tools=TOOLS, max_tokens=12, temperature=0, ignore_eos=True))
    assert pieces[-1].usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert "".join(p.text for p in pieces) == want["choices"][0]["message"]["content"]


@pytest.mark.parametrize("sampling,field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=2.0), "top_p"),
    (dict(max_tokens=10**6), "max_tokens"),
    (dict(regex="("), "structured_outputs"),
])
def test_bad_input_is_invalid_argument_naming_the_field(client, sampling, field):
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("hi", **sampling))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value.details()


def test_model_key_and_detokenize_errors(server, client):
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("hi", model="nope", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with EngineClient(server[1], api_key="wrong") as other, pytest.raises(grpc.RpcError) as e:
        other.list_models()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        client.detokenize([10**7])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.details()


def test_health_and_reflection(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server[1]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pagoda.v1.Engine"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10)
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert {"pagoda.v1.Engine", "grpc.health.v1.Health"} <= names


def _kv_usage(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("pagoda:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no pagoda:kv_cache_usage_perc in /metrics")


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_cancel_and_deadline_abort_the_request_and_free_its_blocks(server, client):
    base, target = server
    stream = client.generate("a long story", max_tokens=10000, ignore_eos=True)
    next(stream)  # running: it holds KV blocks
    assert _kv_usage(base) > 0
    stream.cancel()
    _wait_for(lambda: _kv_usage(base) == 0.0)
    stub = pb_grpc.EngineStub(grpc.insecure_channel(target))
    request = pb.GenerateRequest(prompt="a long story", sampling=pb.SamplingOptions(max_tokens=10000, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, metadata=client.metadata, timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: _kv_usage(base) == 0.0)


def test_engine_limit_is_resource_exhausted(server, client):
    """--max-num-seqs 2 --max-queue-len 0: a third call at once is refused, not queued."""
    base, _ = server
    held = [client.generate("a long story", max_tokens=10000, ignore_eos=True) for _ in range(2)]
    for stream in held:
        next(stream)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("hi", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for stream in held:
        stream.cancel()
    _wait_for(lambda: _kv_usage(base) == 0.0)
