"""A response's output items, built from a choice's parsed deltas (reasoning, content, tool
calls), and the semantic events of its stream: an item is announced (response.output_item.added),
its text or arguments stream (response.output_text.delta, response.reasoning_text.delta,
response.function_call_arguments.delta), and it is closed (…done, response.output_item.done)
before the next one opens; the final response lists the same items with the same ids."""

from __future__ import annotations

from pagoda.entrypoints.openai.responses_protocol import item_id
from pagoda.entrypoints.openai.tool_calls import ToolCall

Event = dict  # one stream event without its sequence number


class ResponseOutput:
    """The output items of one response; `feed` returns the events that announce a delta."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being streamed: the last of `items`

    def feed(self, delta: dict, logprobs: list[dict] | None = None) -> list[Event]:
        """Events for a chat-style delta: `reasoning_content`, `content`, `tool_calls` (calls
        with an `id` open a call; later pieces add to its arguments)."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"], logprobs)
        for call in delta.get("tool_calls", ()):
            function = call.get("function", {})
            if call.get("id"):
                events += self._start({"id": item_id("fc"), "type": "function_call", "call_id": call["id"],
                                       "name": function.get("name", ""), "arguments": "", "status": "in_progress"})
            if function.get("arguments"):
                self.open["arguments"] += function["arguments"]
                events.append(self._about("response.function_call_arguments.delta", delta=function["arguments"]))
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """Close the open item (`status`: completed, or incomplete when the output was cut off)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self.items) - 1
        events: list[Event] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = {"type": kind, **where, "text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = part.get("logprobs", [])
            events += [done, {"type": "response.content_part.done", **where, "part": part}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": item}]

    def add_whole(self, reasoning: str | None, content: str | None, calls: list[ToolCall],
                  logprobs: list[dict] | None = None, status: str = "completed") -> None:
        """A finished choice's items at once (the answer that does not stream)."""
        if reasoning:
            self.feed({"reasoning_content": reasoning})
        if content:
            self.feed({"content": content}, logprobs)
        for call in calls:
            self.feed({"tool_calls": [call.to_openai()]})
        for item in self.items:
            item["status"] = status if item is self.items[-1] else "completed"
        self.open = None

    # -- the open item ----------------------------------------------------------------------
    def _text(self, kind: str, text: str, logprobs: list[dict] | None = None) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != kind:
            part_type = "output_text" if kind == "message" else "reasoning_text"
            part = {"type": part_type, "text": ""}
            if kind == "message":
                item = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": [{**part, "annotations": [], "logprobs": []}]}
            else:
                item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                        "content": [part]}
            events += self._start(item)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)})
        part = self.open["content"][0]
        part["text"] += text
        kind_event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        event = self._about(kind_event, content_index=0, delta=text)
        if kind == "message":
            part["logprobs"] += logprobs or []
            event["logprobs"] = logprobs or []
        return events + [event]

    def _start(self, item: dict) -> list[Event]:
        events = self.close()
        self.items.append(item)
        self.open = item
        announced = {**item, "content": [] if "content" in item else None}
        if announced["content"] is None:
            del announced["content"]
        return events + [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                          "item": announced}]

    def _about(self, kind: str, **fields) -> Event:
        return {"type": kind, "item_id": self.open["id"], "output_index": len(self.items) - 1, **fields}


def assistant_messages(items: list[dict]) -> list[dict]:
    """A response's output as the chat messages that continue its conversation (one assistant
    turn: its text and its calls; reasoning is not sent back)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
