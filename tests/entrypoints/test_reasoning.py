"""Reasoning output (`--reasoning-parser`): the splitter on its own, streamed at every cut equal
to whole, tool calls parsed after the reasoning only; then through a real server, whose chat
template thinks unless `enable_thinking` is off, on every API: chat completions (streamed too),
Responses, Anthropic's Messages and Ollama's chat."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from server_process import _free_port, start_server, stop_process

from pagoda.entrypoints.openai.choice_parser import ChoiceParser
from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS, reasoning_format
from pagoda.entrypoints.openai.tool_calls import ToolChoice

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _parser(name: str, prompt_tail: str = "", tools: ToolChoice | None = None, constrained: bool = False):
    return ChoiceParser(REASONING_PARSERS[name].splitter(prompt_tail, constrained), tools)


def _streamed(parser: ChoiceParser, text: str, step: int) -> tuple[str, str, list[dict]]:
    deltas = [parser.feed(text[i:i + step], 1, False) for i in range(0, len(text), step)] + [parser.feed("", 0, True)]
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas),
            [c for d in deltas for c in d.get("tool_calls", [])])


@pytest.mark.parametrize("name, prompt_tail, text, reasoning, content", [
    ("think", "<|im_start|>assistant\n", "<think>step one</think>\n\nThe answer.", "step one", "The answer."),
    ("think", "<|im_start|>assistant\n", "  <think>\nstep one\n</think>The answer.", "step one\n", "The answer."),
    ("think", "<|im_start|>assistant\n", "No thinking here.", None, "No thinking here."),
    ("think", "<|im_start|>assistant\n", "<think>cut off mid-thou", "cut off mid-thou", None),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "step one</think>The answer.", "step one", "The answer."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "The answer.", None, "The answer."),
    ("deepseek_r1", "<｜Assistant｜>", "step one</think>The answer.", "step one", "The answer."),
    ("deepseek_r1", "<｜Assistant｜>", "<think>step one</think>The answer.", "step one", "The answer."),
    ("deepseek_r1", "<｜Assistant｜></think>", "The answer.", None, "The answer."),
    ("deepseek_r1", "<｜Assistant｜>", "all thought, no end", "all thought, no end", None),
])
def test_the_reasoning_is_split_from_the_answer_whole_and_at_every_cut(name, prompt_tail, text, reasoning, content):
    whole = _parser(name, prompt_tail).whole([(text, 1)])
    assert (whole.reasoning, whole.content or None) == (reasoning, content)
    for step in range(1, len(text) + 1):
        thought, said, _ = _streamed(_parser(name, prompt_tail), text, step)
        assert (thought or None, said or None) == (reasoning, content), step


def test_a_constrained_output_starts_in_the_content():
    assert _parser("deepseek_r1", "<｜Assistant｜>", constrained=True).whole([('{"a": 1}', 1)]).content == '{"a": 1}'
    split = _parser("qwen3", "<think>\n", constrained=True).whole([("<think>x</think>y", 1)])
    assert (split.reasoning, split.content) == ("x", "y")  # where the constraint writes the tags itself


def test_tool_calls_are_parsed_after_the_reasoning_only():
    tools = ToolChoice([WEATHER], "auto", True)
    text = f"<think>I could write {CALL} but first I think.</think>\n{CALL}"
    whole = _parser("think", tools=tools).whole([(text, 1)])
    assert whole.reasoning == f"I could write {CALL} but first I think."
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_weather", {"city": "Paris"})]
    for step in range(1, len(text) + 1):
        thought, said, calls = _streamed(_parser("think", tools=tools), text, step)
        assert thought == whole.reasoning and not said.strip(), step
        assert [(c["function"]["name"], c["index"]) for c in calls] == [("get_weather", 0)], step


def test_reasoning_tokens_count_the_pieces_read_inside_the_reasoning():
    parser = _parser("think")
    pieces = [("<think>", 1), ("a", 1), ("b", 1), ("</think>", 1), ("answer", 1), (" more", 1)]
    assert parser.whole(pieces).reasoning_tokens == 4


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_format("nope")


# -- through a server ---------------------------------------------------------------------------
# ChatML that thinks unless enable_thinking is false (Qwen3's switch): the generation prompt
# opens <think>, or holds an empty think block.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")
# A regex that writes a thought, then the answer: the tiny model's own words between the tags.
THOUGHT_THEN_ANSWER = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>[A-Z][a-z]{2,6}"
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def base(long_tiny_llama, tmp_path_factory, grpc_port):
    template = tmp_path_factory.mktemp("reasoning") / "template.jinja"
    template.write_text(TEMPLATE)
    proc, base = start_server(long_tiny_llama, "--max-model-len", "2048", "--chat-template", str(template),
                              "--reasoning-parser", "qwen3", "--grpc-port", str(grpc_port))
    yield base
    stop_process(proc)


def _chat(base: str, **body) -> dict:
    answer = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": QUESTION, "max_tokens": 16, "temperature": 0, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_chat_completions_carry_reasoning_content_streamed_and_not(base):
    thinking = _chat(base)["choices"][0]["message"]  # the prompt opened <think>: all of it is reasoning
    assert thinking["reasoning_content"] and not thinking["content"]
    off = _chat(base, chat_template_kwargs={"enable_thinking": False})  # the template closed it
    assert off["choices"][0]["message"]["reasoning_content"] is None and off["choices"][0]["message"]["content"]
    assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0

    split = _chat(base, guided_regex=THOUGHT_THEN_ANSWER, max_tokens=40, chat_template_kwargs={"enable_thinking": False})
    message = split["choices"][0]["message"]
    assert message["content"][0].isupper() and " " in message["reasoning_content"]
    assert 0 < split["usage"]["completion_tokens_details"]["reasoning_tokens"] < split["usage"]["completion_tokens"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=40, temperature=0, stream=True,
        extra_body={"guided_regex": THOUGHT_THEN_ANSWER, "chat_template_kwargs": {"enable_thinking": False}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == message["content"]


def test_a_tool_call_after_the_reasoning_is_found_streamed_and_not(base):
    regex = r'<think>[a-z]{2,6}( [a-z]{2,6}){1,2}</think>\n<tool_call>\{"name": "get_weather", "arguments": ' \
            r'\{"city": "[A-Z][a-z]{2,6}"\}\}</tool_call>'
    body = {"tools": [WEATHER], "guided_regex": regex, "max_tokens": 200, "chat_template_kwargs": {"enable_thinking": False}}
    message = _chat(base, **body)["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and message["reasoning_content"] and not message["content"]
    lines = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": QUESTION, "temperature": 0, "stream": True, **body}).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    calls = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in calls] == [call["function"]["arguments"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_messages_and_ollama_send_the_reasoning_apart(base):
    extra = {"guided_regex": THOUGHT_THEN_ANSWER, "chat_template_kwargs": {"enable_thinking": False}}
    expected = _chat(base, max_tokens=40, **extra)["choices"][0]["message"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    response = client.responses.create(model="tiny", input=QUESTION[0]["content"], max_output_tokens=40,
                                       temperature=0, extra_body=extra)
    assert [i.type for i in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == expected["reasoning_content"]
    assert response.output_text == expected["content"] and response.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model="tiny", input=QUESTION[0]["content"], max_output_tokens=40, temperature=0,
                                 extra_body=extra) as stream:
        kinds = [e.type for e in stream]
    assert "response.reasoning_text.delta" in kinds and kinds.index("response.reasoning_text.done") < \
        kinds.index("response.output_text.delta")

    claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    message = claude.messages.create(model="tiny", max_tokens=40, messages=QUESTION,
                                     extra_body={"temperature": 0, **extra})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", expected["reasoning_content"]), ("text", expected["content"])]
    with claude.messages.stream(model="tiny", max_tokens=40, messages=QUESTION,
                                extra_body={"temperature": 0, **extra}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == expected["reasoning_content"]
    thinking_on = claude.messages.create(model="tiny", max_tokens=8, messages=QUESTION, extra_body={"temperature": 0},
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in thinking_on.content] == ["thinking"]  # the template opened <think>

    ollama = httpx.post(f"{base}/api/chat", timeout=60, json={
        "model": "tiny", "messages": QUESTION, "stream": False, "think": True,
        "options": {"temperature": 0, "num_predict": 8}}).json()
    assert ollama["message"]["thinking"] and not ollama["message"]["content"]
    off = httpx.post(f"{base}/api/chat", timeout=60, json={
        "model": "tiny", "messages": QUESTION, "stream": False, "think": False,
        "options": {"temperature": 0, "num_predict": 8}}).json()
    assert "thinking" not in off["message"] and off["message"]["content"]


def test_grpc_chat_carries_the_reasoning_on_its_last_piece(base, grpc_port):
    from pagoda.client import EngineClient

    expected = _chat(base, max_tokens=40, guided_regex=THOUGHT_THEN_ANSWER)["choices"][0]["message"]
    with EngineClient(f"127.0.0.1:{grpc_port}") as client:
        pieces = list(client.chat(QUESTION, regex=THOUGHT_THEN_ANSWER, max_tokens=40, temperature=0))
    assert pieces[-1].reasoning == expected["reasoning_content"]  # the prompt opened <think>: constrained, the
    assert "".join(p.text for p in pieces).endswith(expected["content"])  # regex wrote the tags itself
