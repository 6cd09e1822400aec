"""Input handling of `pagoda serve` (issue 11): model aliases, clean OpenAI-style error bodies,
/tokenize on malformed messages, limits on oversized and adversarial bodies. Against one real
server on 127.0.0.1, serving the tiny model under a catalog name (so the catalog's aliases apply),
with one injected bug to see what an unexpected exception looks like from outside."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_process import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from fuzz_server import drain_log  # noqa: E402

SERVED = "smollm2-135m-instruct"  # a catalog name, so the server also takes the alias `smollm2`
BOOM = "__pagoda_test_internal_error__"
SLOW = 5.0  # a generous sanity bound for "fails fast"; the real times are ~0.1-1 s

# The real server, plus one bug: tokenizing BOOM raises an exception no handler expects.
_SERVER_WITH_A_BUG = f"""
import sys
from pagoda.tokenizer import Tokenizer
real_encode = Tokenizer.encode
def encode(self, text, add_special_tokens=True):
    if text == {BOOM!r}:
        raise KeyError("internal detail: /secret/path.py")
    return real_encode(self, text, add_special_tokens)
Tokenizer.encode = encode
from pagoda.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def served(tiny_llama):
    proc, base = start_server(tiny_llama, name=SERVED, launcher=["-c", _SERVER_WITH_A_BUG])
    log = drain_log(proc)
    yield base, log
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _post(server: str, path: str, **kwargs) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(f"{server}{path}", timeout=60, **kwargs)
    return r, time.monotonic() - start


def _error(r: httpx.Response, status: int, param: str | None = "<any>") -> dict:
    """The OpenAI-style error of `r`, checked: status, shape, param, nothing internal."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    for leak in ('File "', "Traceback", "{'", "api_server.py", "/secret/"):
        assert leak not in r.text, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param != "<any>":
        assert err["param"] == param, err
    return err


# -- 1. model aliases ---------------------------------------------------------------------------
@pytest.mark.parametrize("model", [SERVED, "smollm2", None])
def test_every_name_of_the_served_model_is_accepted(server, model):
    body = {"prompt": "Hi", "max_tokens": 2, **({"model": model} if model else {})}
    r, _ = _post(server, "/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == SERVED
    r, _ = _post(server, "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    r, _ = _post(server, "/tokenize", json={"model": model, "prompt": "Hi"})
    assert r.status_code == 200


def test_unknown_model_404_lists_the_names_that_work(server):
    r, _ = _post(server, "/v1/completions", json={"model": "smollm3", "prompt": "Hi"})
    err = _error(r, 404, "model")
    assert err["code"] == "model_not_found" and "`smollm3`" in err["message"]
    assert f"`{SERVED}`" in err["message"] and "`smollm2`" in err["message"]
    assert [m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]] == [SERVED]


# -- 2. clean error bodies ------------------------------------------------------------------------
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("kwargs, says", [
    ({"json": [1, 2]}, "must be a JSON object, got an array"),
    ({"json": "a string"}, "must be a JSON object, got a string"),
    ({"content": b'{"prompt": "Hi"}'}, "Content-Type: application/json"),  # no content type
    ({"content": b'{"prompt": "Hi"}', "headers": {"content-type": "application/x-www-form-urlencoded"}},
     "Content-Type: application/json"),
    ({"content": b'{"prompt": "Hi", "max_tokens": 2,,}', "headers": JSON}, "not valid JSON"),
    ({"content": b'{"prompt": "\xff"}', "headers": JSON}, "not UTF-8"),
    ({"content": b"", "headers": JSON}, "body is missing"),
])
def test_unreadable_bodies_say_so_without_internals(server, kwargs, says):
    r, _ = _post(server, "/v1/completions", **kwargs)
    err = _error(r, 400, None)
    assert says in err["message"]


def test_malformed_json_gives_the_position_in_the_message_not_the_param(server):
    r, _ = _post(server, "/v1/completions", content=b'{"prompt": "Hi",, "max_tokens": 2}', headers=JSON)
    err = _error(r, 400, None)
    assert "character 16" in err["message"] and "JSON decode error" not in err["message"]


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "'user'"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {}, "messages", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "valid string"),
    ("/v1/completions", {"prompt": {"text": "Hi"}}, "prompt", "prompt must be a string"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**70}, "seed", "less than or equal"),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**70}, "top_k", "less than or equal"),
    ("/detokenize", {"tokens": [1, "two"]}, "tokens.1", "valid integer"),
])
def test_invalid_fields_are_named_by_param(server, path, body, param, says):
    r, _ = _post(server, path, json=body)
    err = _error(r, 400, param)
    assert err["type"] == "invalid_request_error" and says in err["message"]
    assert err["message"].startswith(param) or err["message"].startswith(param.split(".")[0])


def test_nan_and_infinity_are_refused(server):
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        r, _ = _post(server, "/v1/completions", content=b'{"prompt": "Hi", "temperature": ' + literal + b"}", headers=JSON)
        assert "finite" in _error(r, 400, "temperature")["message"]


def test_a_prompt_over_the_context_names_the_prompt(server):
    long = "hello " * 300  # ~1200 tokens of the tiny model; its context is 256
    for body in ({"prompt": long}, {"prompt": long, "max_tokens": 5}):
        r, _ = _post(server, "/v1/completions", json=body)
        assert _error(r, 400, "prompt")["code"] == "context_length_exceeded"
    r, _ = _post(server, "/v1/chat/completions", json={"messages": [{"role": "user", "content": long}], "max_tokens": 5})
    assert _error(r, 400, "messages")["code"] == "context_length_exceeded"
    # The prompt fits; max_tokens is what does not.
    r, _ = _post(server, "/v1/completions", json={"prompt": "Hi", "max_tokens": 1000})
    assert "1000" in _error(r, 400, "max_tokens")["message"]


def test_unknown_route_and_method_are_openai_style(server):
    r = httpx.get(f"{server}/v1/nothing-here")
    assert "/v1/nothing-here" in _error(r, 404)["message"]
    r = httpx.get(f"{server}/v1/completions")
    assert _error(r, 405)["message"] and r.headers["allow"] == "POST"


def test_an_unexpected_exception_is_a_bare_500_with_the_traceback_in_the_log(served):
    server, log = served
    r, _ = _post(server, "/tokenize", json={"prompt": BOOM})
    err = _error(r, 500, None)
    assert err == {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}
    deadline = time.monotonic() + 10
    while not any("/secret/path.py" in line for line in log) and time.monotonic() < deadline:
        time.sleep(0.05)  # polls for the log line; correctness does not hang on this delay
    text = "".join(log)
    assert "Traceback" in text and "/secret/path.py" in text
    assert httpx.get(f"{server}/health").status_code == 200


# -- 3. /tokenize takes what chat takes -----------------------------------------------------------
@pytest.mark.parametrize("messages, param", [
    ([{"role": "tool", "content": [{}]}], "messages.0.content.0.type"),  # schemathesis' 500
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content.0.text"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
     "messages.0.tool_calls.0.function.name"),
    ([], "messages"),
])
def test_tokenize_malformed_messages_are_400(server, messages, param):
    for path in ("/tokenize", "/v1/chat/completions"):
        r, _ = _post(server, path, json={"messages": messages, "max_tokens": 2})
        _error(r, 400, param)


def test_tokenize_messages_count_as_chat_does(server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]
    tokens = _post(server, "/tokenize", json={"messages": messages})[0].json()
    same = _post(server, "/tokenize", json={"messages": [{"role": "user", "content": "Hello there"}]})[0].json()
    chat = _post(server, "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})[0].json()
    assert tokens["tokens"] == same["tokens"] and tokens["count"] == chat["usage"]["prompt_tokens"]


# -- 4. oversized and adversarial bodies -----------------------------------------------------------
def _deep(depth: int) -> bytes:
    return b'{"prompt": "Hi", "max_tokens": 2, "guided_json": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"


def _chunks(total: int, size: int = 1 << 20):
    yield b'{"prompt": "'
    for _ in range(total // size):
        yield b"a" * size
    yield b'"}'


TEN_MB = "hello " * 1_750_000


@pytest.mark.parametrize("label, path, kwargs, status, param", [
    ("nested past the parser", "/v1/completions", {"content": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                                   "headers": JSON}, 400, None),
    ("nested past the limit", "/v1/completions", {"content": _deep(200), "headers": JSON}, 400, "guided_json"),
    ("deep tools", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "x"}],
                                                     "tools": json.loads("[" * 100 + "]" * 100)}}, 400, "tools"),
    ("10 MB prompt", "/v1/completions", {"json": {"prompt": TEN_MB, "max_tokens": 2}}, 400, "prompt"),
    ("10 MB chat", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": TEN_MB}]}}, 400, "messages"),
    ("10 MB tokenize", "/tokenize", {"json": {"prompt": TEN_MB}}, 400, "prompt"),
    ("2M token ids", "/v1/completions", {"content": json.dumps({"prompt": list(range(2_000_000))}).encode(),
                                         "headers": JSON}, 400, "prompt"),
    ("a prompt list too long", "/v1/completions", {"json": {"prompt": ["Hi"] * 5000}}, 400, "prompt"),
    ("many messages", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": ""}] * 5000}},
     400, "messages"),
    ("40 MB body", "/v1/completions", {"content": b'{"prompt": "' + b"a" * 40_000_000 + b'"}', "headers": JSON}, 413, None),
    ("40 MB chunked body", "/v1/completions", {"content": _chunks(40_000_000), "headers": JSON}, 413, None),
    ("n 1000", "/v1/completions", {"json": {"prompt": "Hi", "n": 1000, "max_tokens": 2}}, 400, "n"),
    ("10,000 stop strings", "/v1/completions", {"json": {"prompt": "Hi", "stop": [f"s{i}" for i in range(10_000)]}},
     400, "stop"),
    ("10,000 stop ids", "/v1/completions", {"json": {"prompt": "Hi", "stop_token_ids": list(range(10_000))}},
     400, "stop_token_ids"),
    ("huge logit_bias", "/v1/completions", {"json": {"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(100_000)}}},
     400, "logit_bias"),
])
def test_adversarial_bodies_fail_fast(server, label, path, kwargs, status, param):
    r, elapsed = _post(server, path, **kwargs)
    err = _error(r, status, param)
    assert elapsed < SLOW, f"{label}: {elapsed:.1f} s"
    if status == 413:
        assert err["code"] == "request_too_large" and str(32 * 1024 * 1024) in err["message"]


def test_limits_leave_room_for_ordinary_requests(server):
    body = {"prompt": "Hi", "max_tokens": 2, "n": 3, "stop": [f"s{i}" for i in range(64)],
            "logit_bias": {str(i): 1 for i in range(300)}}
    r, _ = _post(server, "/v1/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    r, _ = _post(server, "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "guided_json": schema})
    assert r.status_code == 200
    assert httpx.get(f"{server}/health").status_code == 200
