"""OpenAI Responses request bodies, and their translation into a chat request: `instructions`
become the system message, input items (messages, function calls, their outputs) chat messages,
flat function `tools` chat's nested ones, `text.format` a response_format,
`max_output_tokens` max_tokens. Items are kept with ids, as the Responses API lists them."""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import Field, field_validator

from pagoda.entrypoints.input_limits import check_json
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest, Int64, OpenAIBase, RequestBody,
)
from pagoda.entrypoints.openai.extension_fields import extension_fields



def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class TextFormat(OpenAIBase):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBase):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Int64 | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int64 | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @field_validator("input", "tools", "tool_choice", mode="before")
    @classmethod
    def _bounded(cls, value: Any, info) -> Any:
        return check_json(value, info.field_name)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids (a string is one user message)."""
    if isinstance(body.input, str):
        return [_message_item("user", [{"type": "input_text", "text": body.input}])]
    items = []
    for i, item in enumerate(body.input):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message_item(_role(item, i), _parts(item.get("content"), i), item.get("id")))
        elif kind == "function_call":
            _need(item, ("call_id", "name", "arguments"), i)
            items.append({"id": item.get("id") or item_id("fc"), "type": "function_call", "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            _need(item, ("call_id", "output"), i)
            items.append({"id": item.get("id") or item_id("fco"), "type": "function_call_output",
                          "call_id": item["call_id"], "output": _output_text(item["output"], i), "status": "completed"})
        elif kind == "reasoning":
            items.append({**item, "id": item.get("id") or item_id("rs")})
        else:
            raise ValueError(f"input[{i}]: items of type {kind!r} are not supported; pagoda takes messages, "
                             "function_call, function_call_output and reasoning items")
    return items


def _message_item(role: str, content: list[dict], given_id: str | None = None) -> dict:
    return {"id": given_id or item_id("msg"), "type": "message", "role": role, "content": content,
            "status": "completed"}


def _role(item: dict, i: int) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ValueError(f"input[{i}].role must be user, assistant, system or developer")
    return role


def _parts(content: Any, i: int) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"input[{i}].content must be a string or a list of content parts")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise ValueError(f"input[{i}].content: an input_image part needs image_url (a data: URL, or a file "
                                 "or remote URL the server allows); file_id is not supported")
        elif kind not in ("input_text", "output_text", "text", "refusal"):
            raise ValueError(f"input[{i}].content: a {kind} part is not supported; pagoda takes text and input_image")
    return content


def _output_text(output: Any, i: int) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(_part_text(p) for p in _parts(output, i))
    raise ValueError(f"input[{i}].output must be a string or a list of text parts")


def _part_text(part: dict) -> str:
    return part.get("refusal" if part.get("type") == "refusal" else "text") or ""


def _need(item: dict, keys: tuple[str, ...], i: int) -> None:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise ValueError(f"input[{i}].{key} must be a string")


def chat_messages(items: list[dict]) -> list[dict]:
    """Items as chat messages: a function call joins the assistant turn before it; its output is
    a tool message; reasoning items are not sent back to the model."""
    out: list[dict] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _chat_content(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def _chat_content(parts: list[dict]) -> str | list[dict]:
    """A message's parts as chat content: its text, or, with images, chat's text and image_url
    parts in their order (the chat path checks the images and places their tokens)."""
    if not any(p.get("type") == "input_image" for p in parts):
        return "".join(_part_text(p) for p in parts)
    return [{"type": "image_url", "image_url": {"url": p["image_url"], **({"detail": p["detail"]} if p.get("detail") else {})}}
            if p.get("type") == "input_image" else {"type": "text", "text": _part_text(p)} for p in parts]


def _tools(body: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """(chat tools, chat tool_choice) from the Responses API's flat function tools."""
    tools = []
    for i, tool in enumerate(body.tools or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ValueError(f"tools[{i}]: {kind!r} tools are not supported; pagoda calls function tools")
        tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                      if tool.get(k) is not None}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools or None, choice


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise ValueError("text.format: a json_schema format needs its schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.json_schema,
                                                   "strict": fmt.strict}}


def chat_request(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request that asks the same: instructions, then the earlier conversation
    (`history`, from previous_response_id), then this input (a ValueError names what cannot
    be translated)."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else [])
    messages += history + chat_messages(input_items(body))
    tools, tool_choice = _tools(body)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "tools": tools, "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream, "user": body.user,
        "response_format": _response_format(body), "logprobs": bool(body.top_logprobs),
        "top_logprobs": body.top_logprobs or None,
        **extension_fields(body)}
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:  # for thinking templates: enable_thinking (Qwen3's switch), reasoning_effort
        fields["chat_template_kwargs"] = {"enable_thinking": effort != "none", "reasoning_effort": effort,
                                          **(fields.get("chat_template_kwargs") or {})}
    return ChatCompletionRequest.model_validate(fields)

