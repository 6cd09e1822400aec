"""Anthropic Messages request bodies, and their translation into an OpenAI chat request: `system`
becomes the system message, content blocks (text, tool_use, tool_result; a user's image as an
`image_url` part) become chat messages,
tool calls and tool results, `tools` / `tool_choice` their OpenAI forms, `stop_sequences` `stop`."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.entrypoints.openai.extension_fields import extension_fields
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest


class ContentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "tool_use", "tool_result", "image", "document", "thinking", "redacted_thinking"]
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # accepted; the answer's length is bounded by max_tokens


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # metadata, service_tier, ...: accepted, not used

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


def _text_of(content: str | list[dict[str, Any]] | list[ContentBlock] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        block_type = block.get("type") if isinstance(block, dict) else block.type
        if block_type != "text":
            raise ValueError(f"a {block_type} block is not supported here; pagoda's models take text")
        parts.append(block["text"] if isinstance(block, dict) else block.text or "")
    return "".join(parts)


def _messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text_of(body.system)})
    for message in body.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        text, calls, images = [], [], []
        for block in message.content:
            if block.type == "text":
                text.append(block.text or "")
                images.append({"type": "text", "text": block.text or ""})
            elif block.type == "image" and message.role == "user":
                images.append({"type": "image_url", "image_url": {"url": _image_url(block)}})
            elif block.type == "tool_use" and message.role == "assistant":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
            elif block.type == "tool_result" and message.role == "user":
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text_of(block.content)})
            elif block.type in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning is not sent back to the model
            else:
                raise ValueError(f"messages: a {block.type} block in a {message.role} message is not supported")
        if text or calls or images or not any(b.type == "tool_result" for b in message.content):
            with_images = any(part["type"] == "image_url" for part in images)  # the parts, in order
            entry: dict[str, Any] = {"role": message.role, "content": images if with_images else "".join(text)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _image_url(block: ContentBlock) -> str:
    """An image block's source as a URL the chat path reads: base64 data as a data: URL, or its url."""
    source = (block.model_extra or {}).get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        return f"data:{source.get('media_type') or 'image/png'};base64,{source.get('data') or ''}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ValueError("messages: an image block's source must be {\"type\": \"base64\", \"media_type\", \"data\"} "
                     "or {\"type\": \"url\", \"url\"}")


def _tools(body: MessagesRequest | CountTokensRequest) -> tuple[list[dict] | None, Any, bool]:
    """(OpenAI tools, OpenAI tool_choice, parallel tool calls)."""
    if not body.tools:
        return None, None, True
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools]
    choice, parallel = body.tool_choice, True
    if choice is None:
        return tools, "auto", parallel
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise ValueError("tool_choice: type 'tool' needs the tool's name")
        return tools, {"type": "function", "function": {"name": choice.name}}, parallel
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI chat request that asks the same (a ValueError names what cannot be translated)."""
    tools, tool_choice, parallel = _tools(body)
    fields: dict[str, Any] = {"model": body.model, "messages": _messages(body), "tools": tools,
                              "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    fields.update(extension_fields(body))  # vLLM's fields (top_k, seed, guided_*, chat_template_kwargs, ...)
    if body.thinking is not None:  # for thinking templates: Qwen3's and others' switch
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled",
                                          **(fields.get("chat_template_kwargs") or {})}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    return ChatCompletionRequest.model_validate(fields)
