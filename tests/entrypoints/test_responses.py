"""The OpenAI Responses API (entrypoints/openai/responses*.py) through the official openai SDK
against a real server: the chat completions answer, the semantic event stream, stored responses
(retrieve, input items, delete), a conversation by previous_response_id whose history stays
cached, a tool round trip streamed and not, structured output, clear errors."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from server_process import start_server, stop_process

BLOCK = 16
INSTRUCTIONS = "You are a terse assistant."
QUESTION = "What is the weather like in Paris?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def base(long_tiny_llama):
    # a context long enough for the tool prompt (the tools' schemas rendered into the system turn)
    proc, base = start_server(long_tiny_llama, "--max-model-len", "2048")
    yield base
    stop_process(proc)


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def _chat(client, messages: list[dict], max_tokens: int, **kw) -> dict:
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, **GREEDY, **kw)
    return answer.model_dump()


def test_a_response_is_the_chat_completions_answer_and_is_stored(client):
    response = client.responses.create(model="tiny", instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=12, **GREEDY)
    chat = _chat(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 12)
    choice = chat["choices"][0]
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    assert response.output_text == choice["message"]["content"]
    assert [item.type for item in response.output] == ["message"]
    if choice["finish_reason"] == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens

    again = client.responses.retrieve(response.id)
    assert again.output_text == response.output_text and again.output[0].id == response.output[0].id
    (item,) = client.responses.input_items.list(response.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == QUESTION
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_the_stream_is_the_semantic_event_sequence_of_the_same_response(client):
    whole = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=12, **GREEDY)
    stop = whole.output_text[len(whole.output_text) // 2:][:2]  # ends the stream early: completed
    expected = whole.output_text[:whole.output_text.index(stop)]
    with client.responses.stream(model="tiny", input=QUESTION, max_output_tokens=12, extra_body={"stop": [stop]},
                                 **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert final.output_text == expected and final.status == "completed"
    assert client.responses.retrieve(final.id).output_text == expected  # a streamed response is stored too

    raw = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=12, stream=True, **GREEDY)
    last = list(raw)[-1]
    if whole.status == "incomplete":
        assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[0].content[0].text == whole.output_text


@pytest.fixture(scope="module")
def offline(long_tiny_llama):
    """The same model in the offline engine, uncached: the reference a continued response must equal."""
    from pagoda import LLM

    return LLM(model=str(long_tiny_llama), dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False)


def test_a_conversation_by_previous_response_id_keeps_its_history_cached(client, offline):
    """The next response's prompt is the tokens the engine computed through the last one (its
    prompt and its answer, as generated) and then the new turn's text: those tokens are cached,
    and the answer is what a fresh, uncached run of that prompt gives."""
    from pagoda import SamplingParams

    def turn(text: str, previous=None, **kw):
        return client.responses.create(model="tiny", previous_response_id=previous, input=text,
                                       max_output_tokens=8, **GREEDY, **kw)

    def fresh(prompt: list[int]) -> list[int]:
        (out,) = offline.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8),
                                  use_tqdm=False)
        return out.outputs[0].token_ids

    tokenizer = offline.engine.tokenizer
    system = [{"role": "system", "content": INSTRUCTIONS}]
    first = turn("alpha bravo charlie delta", instructions=INSTRUCTIONS)
    second = turn("echo foxtrot golf", first.id, instructions=INSTRUCTIONS)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens // BLOCK * BLOCK

    history = [{"role": "user", "content": "alpha bravo charlie delta"}]
    computed = tokenizer.encode_chat(system + history, True)
    computed += fresh(computed)
    assert tokenizer.decode(computed[first.usage.input_tokens:]) == first.output_text
    history += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "echo foxtrot golf"}]
    text, whole = tokenizer.decode(computed, skip_special_tokens=False), tokenizer.apply_chat_template(system + history)
    prompt = computed + tokenizer.encode(whole[len(text):], add_special_tokens=False)
    assert second.usage.input_tokens == len(prompt) and second.output_text == tokenizer.decode(fresh(prompt))

    third = turn("hotel", second.id, instructions=INSTRUCTIONS)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.total_tokens // BLOCK * BLOCK
    bare = turn("echo foxtrot golf", first.id)  # instructions are not carried on (as OpenAI's)
    assert bare.instructions is None and bare.usage.input_tokens < second.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, stream):
    kw = {"model": "tiny", "input": QUESTION, "tools": [WEATHER], "max_output_tokens": 40,
          "tool_choice": {"type": "function", "name": "get_weather"}, **GREEDY}
    if stream:
        with client.responses.stream(**kw) as s:
            kinds = [e.type for e in s]
            called = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        called = client.responses.create(**kw)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert call.call_id.startswith("call_") and call.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    # the conversation goes on by previous_response_id, or with the call passed back as input
    on = client.responses.create(model="tiny", previous_response_id=called.id, input=[result], tools=[WEATHER],
                                 max_output_tokens=6, **GREEDY)
    passed = client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=6, **GREEDY, input=[
        {"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result])
    assert on.output_text == passed.output_text and on.usage.input_tokens == passed.usage.input_tokens
    items = client.responses.input_items.list(on.id).data
    assert [i.type for i in items] == ["function_call_output"] and items[0].call_id == call.call_id


def test_text_format_constrains_the_output_to_a_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=40, **GREEDY, text={
        "format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    assert set(json.loads(response.output_text)) == {"city"}


def test_input_items_are_listed_a_page_at_a_time(client):
    turns = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
             {"role": "user", "content": [{"type": "input_text", "text": "three"}]}]
    response = client.responses.create(model="tiny", input=turns, max_output_tokens=2, **GREEDY)
    newest = client.responses.input_items.list(response.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["three", "two"] and newest.has_more
    rest = client.responses.input_items.list(response.id, limit=2, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["one"] and not rest.has_more
    oldest = client.responses.input_items.list(response.id, order="asc")
    assert [i.role for i in oldest.data] == ["user", "assistant", "user"]


def test_a_background_response_is_polled_and_can_be_cancelled(client):
    ask = {"model": "tiny", "input": QUESTION, "max_output_tokens": 12, **GREEDY}
    started = client.responses.create(background=True, **ask)
    assert started.background and started.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(started.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.output_text == client.responses.create(**ask).output_text and done.usage.output_tokens > 0

    long = client.responses.create(background=True, model="tiny", input=QUESTION, max_output_tokens=1500,
                                   extra_body={"ignore_eos": True}, **GREEDY)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(**ask).id)  # only background responses


def test_bad_requests_get_clear_errors(client, base):
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny", previous_response_id="resp_nope", input="hi", max_output_tokens=2)
    assert missing.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    def refused(body: dict) -> dict:
        answer = httpx.post(f"{base}/v1/responses", json={"model": "tiny", "max_output_tokens": 2, **body}, timeout=30)
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    assert refused({"input": [{"type": "computer_call"}]})["param"] == "input"
    assert "image" in refused({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})["message"]
    assert refused({"input": "hi", "tools": [{"type": "web_search"}]})["param"] == "tools"
    assert refused({"input": "hi", "background": True, "stream": True})["param"] == "background"
    assert refused({"input": "hi", "background": True, "store": False})["param"] == "background"
    assert refused({"input": "hi", "max_output_tokens": 0})["param"] == "max_output_tokens"
    assert refused({})["param"] == "input"
