"""OpenAI tool calling for chat: prompt rendering, constraints, and parsing Hermes-style calls.

- Tools reach the model through its chat template when the template takes `tools`; otherwise a
  system prompt in the Hermes format (`DEFAULT_TOOL_PROMPT`) lists them.
- `tool_choice="required"` or a named function constrains the output with a JSON schema built
  from the functions' parameters, so the arguments always parse:
  required → `[{"name": ..., "arguments": {...}}, ...]` (one item when parallel_tool_calls is off),
  named → the arguments object itself.
- `tool_choice="auto"` (the default when tools are given) lets the model answer freely; calls
  written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` are parsed out of the text.
- `"none"` leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

DEFAULT_TOOL_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


class ToolChoice:
    """A chat request's tools and tool_choice, validated (ValueError names the field)."""

    def __init__(self, tools: list[dict[str, Any]], tool_choice: str | dict | None, parallel: bool) -> None:
        self.functions = [_function(i, t) for i, t in enumerate(tools)]
        self.by_name = {f["name"]: f for f in self.functions}
        self.parallel = parallel
        self.mode, self.named = _choice(tool_choice, self.by_name)

    @classmethod
    def from_request(cls, tools, tool_choice, parallel: bool) -> "ToolChoice | None":
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ValueError("tool_choice needs tools: give the functions it may call in tools")
            return None
        return cls(tools, tool_choice, parallel)

    @property
    def in_prompt(self) -> bool:
        return self.mode != "none"

    # -- prompt -----------------------------------------------------------------------------
    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]

    def system_prompt(self) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in self.functions)
        return DEFAULT_TOOL_PROMPT.format(tools=listed)

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
            return parse_hermes(text)
        return text, []


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes-style `<tool_call>{json}</tool_call>` blocks → calls; the rest is content.
    A block whose JSON does not parse stays in the content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        calls.append(call)
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesStreamParser:
    """Splits streamed text into content deltas and complete tool calls.

    Text that might be the start of `<tool_call>` is held back until it is known not to be; a
    call is emitted when its closing tag arrives. Unclosed or unparsable blocks come out as
    content when the stream ends.
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = [], []
        while True:
            start = self.buffer.find(TOOL_CALL_OPEN)
            if start < 0:
                safe = len(self.buffer) - partial_suffix(self.buffer, TOOL_CALL_OPEN)
                content.append(self.buffer[:safe])
                self.buffer = self.buffer[safe:]
                break
            end = self.buffer.find(TOOL_CALL_CLOSE, start)
            if end < 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            call = _hermes_call(self.buffer[start + len(TOOL_CALL_OPEN):end].strip())
            stop = end + len(TOOL_CALL_CLOSE)
            if call is None:
                content.append(self.buffer[:stop])
            else:
                content.append(self.buffer[:start])
                calls.append(call)
            self.buffer = self.buffer[stop:]
        self.num_calls += len(calls)
        text = "".join(content)
        if self.num_calls and not text.strip():
            text = ""  # whitespace around calls is not content
        return text, calls

    def flush(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


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
    out = [_as_text(m) for m in messages]
    if tools and tools.in_prompt:
        prompt = tools.system_prompt()
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        text = "".join(
            f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"].get("arguments"))},
                                                ensure_ascii=False) + f"\n{TOOL_CALL_CLOSE}"
            for c in calls)
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
    required: the JSON array is parsed when the choice ends; auto: Hermes blocks are emitted as
    each one closes. Every tool-call delta carries its integer `index`.
    """

    def __init__(self, tools: ToolChoice) -> None:
        self.tools = tools
        self.parser = HermesStreamParser()
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
                content += self.parser.flush()
        else:
            content, calls = text, []
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.to_openai(self.num_calls + i) for i, c in enumerate(calls)]
            self.num_calls += len(calls)
        return delta
