"""Anthropic's Messages API (pagoda/entrypoints/anthropic) through the official `anthropic` SDK
against a real server: the same greedy answer as /v1/chat/completions, streamed and not, a tool
round trip, count_tokens, `x-api-key` checked, errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from server_process import start_server, stop_process

KEY = "sk-anthropic-test"
SYSTEM = "You are a terse assistant."
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def base(long_tiny_llama):
    # a context long enough for the tool prompt (the tools' schemas rendered into the system turn)
    proc, base = start_server(long_tiny_llama, "--api-key", KEY, "--max-model-len", "2048")
    yield base
    stop_process(proc)


@pytest.fixture(scope="module")
def client(base) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)  # the SDK sends x-api-key


# This SDK's create() has no sampling arguments any more; the API's temperature / top_p / top_k
# fields go in the body.
GREEDY = {"extra_body": {"temperature": 0}}


def _create(client, **kw):
    return client.messages.create(model="tiny", max_tokens=kw.pop("max_tokens", 12), system=SYSTEM,
                                  messages=kw.pop("messages", MESSAGES), **GREEDY, **kw)


def test_the_answer_is_the_chat_completions_answer(client, base):
    message = _create(client)
    chat = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, json={
        "model": "tiny", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, *MESSAGES]}).json()
    choice = chat["choices"][0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == choice["message"]["content"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    usage = message.usage
    assert usage.output_tokens == chat["usage"]["completion_tokens"]
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    count = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES)
    assert count.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_stream_is_anthropics_event_sequence_with_the_same_answer(client):
    whole = _create(client)
    with client.messages.stream(model="tiny", max_tokens=12, system=SYSTEM, messages=MESSAGES, **GREEDY) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_is_reported(client):
    text = _create(client).content[0].text
    stop = text[len(text) // 2:][:2]
    message = _create(client, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, stream):
    kw = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 40}
    if stream:
        with client.messages.stream(model="tiny", system=SYSTEM, messages=MESSAGES, **GREEDY, **kw) as s:
            call_message = s.get_final_message()
    else:
        call_message = _create(client, **kw)
    (call,) = [b for b in call_message.content if b.type == "tool_use"]
    assert call_message.stop_reason == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input["city"], str) and call.id.startswith("toolu_")
    answer = _create(client, tools=[WEATHER], messages=[
        *MESSAGES, {"role": "assistant", "content": [b.model_dump() for b in call_message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.usage.output_tokens >= 1


def test_errors_have_anthropics_shape(client, base):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGES)
    assert missing.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{base}/v1/messages", headers={"x-api-key": KEY}, json={"model": "tiny", "messages": MESSAGES})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=MESSAGES)
