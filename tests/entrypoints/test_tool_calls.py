"""Tool calling's pieces without a model: choice validation, constraints, Hermes parsing."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.openai.tool_calls import ToolChoice, render_messages
from pagoda.entrypoints.openai.tool_formats import HermesStreamParser, parse_hermes

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "now"}},
]
TEXT = ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call> done')


def test_parse_hermes_extracts_calls_and_keeps_the_rest():
    content, calls = parse_hermes(TEXT)
    assert [c.name for c in calls] == ["add", "now"]
    assert json.loads(calls[0].arguments) == {"a": 1} and calls[0].id != calls[1].id
    assert content == "Sure. \n done"
    broken = 'x <tool_call>{"name": "add", "argu</tool_call>'
    assert parse_hermes(broken) == (broken, [])


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_stream_parser_gives_the_same_calls_whatever_the_chunking(step):
    parser = HermesStreamParser()
    content, calls = "", []
    for i in range(0, len(TEXT), step):
        text, new = parser.feed(TEXT[i:i + step])
        content += text
        calls += new
    content += parser.flush()[0]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}), ("now", {})]
    assert "<tool_call>" not in content and content.startswith("Sure.") and content.endswith("done")


def test_stream_parser_releases_text_that_only_looked_like_a_tag():
    parser = HermesStreamParser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("box>") == ("<toolbox>", [])
    assert parser.feed("<tool_call>{unclosed") == ("", [])
    assert parser.flush() == ("<tool_call>{unclosed", [])


def test_tool_choice_validation():
    with pytest.raises(ValueError, match="tool_choice names function 'sub'"):
        ToolChoice(TOOLS, {"type": "function", "function": {"name": "sub"}}, True)
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        ToolChoice([{"type": "retrieval"}], "auto", True)
    with pytest.raises(ValueError, match="tool_choice must be"):
        ToolChoice(TOOLS, "sometimes", True)
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        ToolChoice.from_request(None, "required", True)
    assert ToolChoice.from_request(None, None, True) is None


def test_required_constraint_admits_exactly_the_tools():
    jsonschema = pytest.importorskip("jsonschema")
    schema = ToolChoice(TOOLS, "required", parallel=False).constraint().json
    jsonschema.validate([{"name": "add", "arguments": {"a": 2}}], schema)
    for bad in ([], [{"name": "mul", "arguments": {}}], [{"name": "now", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    _, calls = ToolChoice(TOOLS, "required", True).parse('[{"name": "add", "arguments": {"a": 2}}]')
    assert calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 2}
    named = ToolChoice(TOOLS, {"type": "function", "function": {"name": "add"}}, True)
    assert named.constraint().json == TOOLS[0]["function"]["parameters"]


def test_messages_without_tool_support_in_the_template():
    tools = ToolChoice(TOOLS, "auto", True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                                      "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "2"}]
    out, extra = render_messages(messages, tools, template_takes_tools=False)
    assert extra == {}
    assert out[0]["content"].startswith("Be brief.") and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}
    same, extra = render_messages(messages, tools, template_takes_tools=True)
    assert same is messages and [t["function"]["name"] for t in extra["tools"]] == ["add", "now"]
    none = ToolChoice(TOOLS, "none", True)
    assert render_messages(messages[:2], none, template_takes_tools=False)[0][0]["content"] == "Be brief."
