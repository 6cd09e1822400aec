"""The tool-call formats of `--tool-call-parser` (entrypoints/openai/tool_formats.py): each read
whole and streamed at every cut alike, content that only looked like a call kept as content,
calls written back the way they are read; then each through a real server, the model's output
shaped into that format by a regex, streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import start_server, stop_process

from pagoda.entrypoints.openai.tool_formats import TOOL_CALL_FORMATS, tool_call_format

WEATHER_PARIS = ("get_weather", {"city": "Paris"})
TIME_UTC = ("get_time", {"zone": "UTC", "precise": True, "digits": [1, 2]})

# (format, the model's text, the content, the calls)
CASES = [
    ("hermes", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
     "Sure.", [WEATHER_PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"zone": "UTC", "precise": true, "digits": [1, 2]}}',
     None, [WEATHER_PARIS, TIME_UTC]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER_PARIS]),
    ("pythonic", '[get_weather(city="Paris"), get_time(zone=\'UTC\', precise=True, digits=[1, 2])]',
     None, [WEATHER_PARIS, TIME_UTC]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [WEATHER_PARIS]),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"zone": "UTC", "precise": true, "digits": [1, 2]}}]',
     "Let me check.", [WEATHER_PARIS, TIME_UTC]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
     '{"zone": "UTC", "precise": true, "digits": [1, 2]}', None, [WEATHER_PARIS, TIME_UTC]),
]
# Text each format must leave as content (not a call, or a call that does not parse).
NOT_CALLS = [
    ("hermes", 'a <tool_call>{"name": "get_weather", "argu</tool_call>'),
    ("llama3_json", "Paris is sunny {mostly}."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("pythonic", "[1, 2, 3] are numbers"),
    ("pythonic", "[get_weather(city=open('x'))]"),
    ("mistral", "No calls [TOOL here."),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "argum'),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(name: str, text: str, step: int) -> tuple[str, list]:
    parser = tool_call_format(name).streamer()
    content, calls = "", []
    for i in range(0, len(text), step):
        piece, new = parser.feed(text[i:i + step])
        content, calls = content + piece, calls + new
    piece, new = parser.flush()
    return content + piece, calls + new


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_calls_are_read_whole_and_at_every_cut(name, text, content, calls):
    whole_content, whole_calls = tool_call_format(name).parse(text)
    assert (whole_content, _calls(whole_calls)) == (content, calls)
    for step in range(1, len(text) + 1):
        streamed_content, streamed_calls = _streamed(name, text, step)
        assert (streamed_content.strip() or None, _calls(streamed_calls)) == (content, calls), step


@pytest.mark.parametrize("name, text", NOT_CALLS)
def test_what_is_not_a_call_stays_content(name, text):
    assert tool_call_format(name).parse(text) == (text, [])
    for step in (1, 3, len(text)):
        assert _streamed(name, text, step) == (text, []), step


@pytest.mark.parametrize("name", ["llama3_json", "pythonic", "mistral"])
def test_plain_answers_stream_without_waiting_for_the_end(name):
    parser = tool_call_format(name).streamer()
    assert parser.feed("The weather ") == ("The weather ", [])
    assert parser.feed("is fine.") == ("is fine.", [])


@pytest.mark.parametrize("name", sorted(TOOL_CALL_FORMATS))
def test_calls_written_back_are_read_as_the_same_calls(name):
    fmt = tool_call_format(name)
    written = fmt.write_calls([{"name": n, "arguments": a} for n, a in (WEATHER_PARIS, TIME_UTC)])
    assert _calls(fmt.parse(written)[1]) == [WEATHER_PARIS, TIME_UTC]
    assert "get_weather" in fmt.system_prompt([{"name": "get_weather", "parameters": {}}])


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="pythonic"):
        tool_call_format("xml")


# -- through a server ---------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY = r"[A-Z][a-z]{2,6}"
REGEXES = {  # the model's answer shaped into each format, the city its own choice
    "hermes": r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "' + CITY + r'"\}\}</tool_call>',
    "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "' + CITY + r'"\}\}',
    "pythonic": r'\[get_weather\(city="' + CITY + r'"\)\]',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "' + CITY + r'"\}\}\]',
}


@pytest.fixture(scope="module", params=sorted(REGEXES))
def served(request, long_tiny_llama):
    proc, base = start_server(long_tiny_llama, "--max-model-len", "2048", "--tool-call-parser", request.param)
    yield request.param, base
    stop_process(proc)


def test_each_format_is_parsed_by_the_server_streamed_and_not(served):
    name, base = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "guided_regex": REGEXES[name], "max_tokens": 200, "temperature": 0}
    choice = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    lines = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    streamed = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in streamed] == [call["function"]["arguments"]]
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
