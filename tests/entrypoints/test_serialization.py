"""The server's JSON (orjson): what it writes for the values we emit, and non-ASCII text end to end."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
from server_process import start_server

from pagoda.entrypoints.openai.response_parts import dumps, sse

TEXT = "你好，世界。 Emoji: 😀🚀 é"


def test_sse_framing():
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'


def test_non_ascii_is_written_unescaped():
    body = dumps({"text": TEXT})
    assert TEXT.encode() in body and b"\\u" not in body
    assert json.loads(body) == {"text": TEXT}


def test_the_values_we_emit_round_trip():
    lp = -0.12345678901234567
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1764400000, "model": "m",
             "choices": [{"index": 0, "delta": {"content": " the"}, "finish_reason": None, "stop_reason": None,
                          "logprobs": {"content": [{"token": " the", "logprob": lp, "bytes": list(b" the"),
                                                    "top_logprobs": [{"token": "é", "logprob": -3.5e-9,
                                                                      "bytes": list("é".encode())}]}]}}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                       "prompt_tokens_details": {"cached_tokens": 0}}, "flag": True}
    assert json.loads(dumps(chunk)) == chunk  # floats keep every digit
    assert json.loads(dumps({1: "a"})) == json.loads(json.dumps({1: "a"})) == {"1": "a"}


def test_non_finite_floats_become_null():
    # Logprobs are log_softmax of finite logits, so they are finite; should a -inf or nan reach a
    # body, it is written as null (valid JSON), not as json.dumps' -Infinity that strict parsers reject.
    assert json.loads(dumps({"logprob": -math.inf, "x": math.nan, "y": math.inf})) == {"logprob": None, "x": None, "y": None}


@pytest.fixture(scope="module")
def server(tiny_llama):
    proc, base = start_server(tiny_llama, name="tiny")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def test_non_ascii_through_the_server(server):
    """The tiny tokenizer knows these characters: echo sends the prompt back in both body kinds."""
    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 2, "echo": True, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json=body)
    assert r.status_code == 200 and TEXT.encode() in r.content and b"\\u" not in r.content
    assert r.json()["choices"][0]["text"].startswith(TEXT)
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}) as s:
        raw = s.read()
    assert TEXT.encode() in raw and b"\\u" not in raw
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    chunks = list(client.completions.create(**body, stream=True))
    assert chunks[0].choices[0].text == TEXT
    out = client.completions.create(**body, logprobs=2)
    assert out.choices[0].text.startswith(TEXT) and len(out.choices[0].logprobs.token_logprobs) > 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": TEXT}], max_tokens=3,
                                          logprobs=True, top_logprobs=2)
    assert all(math.isfinite(c.logprob) for c in chat.choices[0].logprobs.content)
