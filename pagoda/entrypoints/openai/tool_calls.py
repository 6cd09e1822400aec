"""OpenAI tool calling for chat: prompt rendering, constraints, and parsing the calls the model
writes, in the format `--tool-call-parser` names (tool_formats.py; Hermes by default).

- Tools reach the model through its chat template when the template takes `tools`; otherwise a
  system prompt lists them and says how to call in that format.
- `tool_choice="required"` or a named function constrains the output with a JSON schema built
  from the functions' parameters, so the arguments always parse:
  required → `[{"name": ..., "arguments": {...}}, ...]` (one item when parallel_tool_calls is off),
  named → the arguments object itself.
- `tool_choice="auto"` (the default when tools are given) lets the model answer freely; calls
  written in the format (Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) are
  parsed out of the text.
- `"none"` leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.entrypoints.openai.tool_formats import ToolCall, ToolCallFormat, tool_call_format
from pagoda.sampling_params import StructuredOutputsParams


class ToolChoice:
    """A chat request's tools and tool_choice, validated (ValueError names the field)."""

    def __init__(self, tools: list[dict[str, Any]], tool_choice: str | dict | None, parallel: bool,
                 fmt: ToolCallFormat | None = None) -> None:
        self.functions = [_function(i, t) for i, t in enumerate(tools)]
        self.by_name = {f["name"]: f for f in self.functions}
        self.parallel = parallel
        self.mode, self.named = _choice(tool_choice, self.by_name)
        self.fmt = fmt or tool_call_format(None)  # how the model writes calls (--tool-call-parser)

    @classmethod
    def from_request(cls, tools, tool_choice, parallel: bool, fmt: ToolCallFormat | None = None) -> "ToolChoice | None":
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ValueError("tool_choice needs tools: give the functions it may call in tools")
            return None
        return cls(tools, tool_choice, parallel, fmt)

    @property
    def in_prompt(self) -> bool:
        return self.mode != "none"

    # -- prompt -----------------------------------------------------------------------------
    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]

    def system_prompt(self) -> str:
        return self.fmt.system_prompt(self.functions)

    # -- constraint -------------------------------------------------------------------------
    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self.by_name[self.named]))
        if self.mode == "required":
            items = {"anyOf": [
                {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for f in self.functions
            ]}
            schema: dict = {"type": "array", "items": items, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    # -- output -----------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The model's text → (content, tool calls)."""
        if self.mode == "named":
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(i["name"], json.dumps(i["arguments"], ensure_ascii=False)) for i in items]
            except (ValueError, TypeError, KeyError):
                return text, []  # cut short by max_tokens: hand back what there is
        if self.mode == "auto":
            return self.fmt.parse(text)
        return text, []


def _function(i: int, tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tools[{i}].function.name must be a non-empty string")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return {k: v for k, v in fn.items() if k in ("name", "description", "parameters")}


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _choice(tool_choice: str | dict | None, by_name: dict) -> tuple[str, str | None]:
    if tool_choice is None or tool_choice == "auto":
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") == "function" and isinstance(name, str):
            if name not in by_name:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools ({', '.join(by_name)})")
            return "named", name
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


def render_messages(messages: list[dict], tools: ToolChoice | None, template_takes_tools: bool) -> tuple[list[dict], dict]:
    """Messages and extra template arguments for a chat with tools.

    With a template that takes tools, the messages go as they are, with `tools=`. Otherwise the
    tools become a system prompt, and earlier calls and results become text the model can read.
    """
    if template_takes_tools:
        return messages, ({"tools": tools.template_tools()} if tools and tools.in_prompt else {})
    fmt = tools.fmt if tools else tool_call_format(None)
    out = [_as_text(m, fmt) for m in messages]
    if tools and tools.in_prompt:
        prompt = tools.system_prompt()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _as_text(message: dict, fmt: ToolCallFormat) -> dict:
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        text = fmt.write_calls([{"name": c["function"]["name"], "arguments": _loads(c["function"].get("arguments"))}
                                for c in calls])
        return {"role": "assistant", "content": ((message.get("content") or "") + text)}
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    return {"role": message["role"], "content": message.get("content") or ""}


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


class ToolCallStream:
    """One streamed chat choice with tools: text deltas → chat deltas (content and/or tool_calls).

    named: the call (id, name) opens at once and the arguments stream as they are generated;
    required: the JSON array is parsed when the choice ends; auto: the format's calls are emitted as
    each one closes. Every tool-call delta carries its integer `index`.
    """

    def __init__(self, tools: ToolChoice) -> None:
        self.tools = tools
        self.parser = tools.fmt.streamer()
        self.text = ""
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> dict:
        mode = self.tools.mode
        if mode == "named":
            if self.num_calls == 0:
                self.num_calls = 1
                return {"tool_calls": [ToolCall(self.tools.named, text).to_openai(0)]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if mode == "required":
            self.text += text
            if not finished:
                return {}
            content, calls = self.tools.parse(self.text)
        elif mode == "auto":
            content, calls = self.parser.feed(text)
            if finished:
                rest, more = self.parser.flush()
                content, calls = content + rest, calls + more
        else:
            content, calls = text, []
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.to_openai(self.num_calls + i) for i, c in enumerate(calls)]
            self.num_calls += len(calls)
        return delta
