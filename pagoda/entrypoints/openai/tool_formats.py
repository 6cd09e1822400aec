"""The ways models write tool calls (`--tool-call-parser`), each read whole and as it streams,
and each told to a model whose chat template does not take tools (a system prompt, and earlier
calls written back as text):

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among the text
  (Qwen, Hermes, SmolLM2); each call is sent as its closing tag arrives.
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}` objects separated by
  `;`, after an optional `<|python_tag|>` (Llama 3.1 / 3.2).
- `pythonic`: the whole answer is a Python list of calls, `[get_weather(city="Paris")]`, between
  optional `<|python_start|>` / `<|python_end|>` (Llama 3.2 / 4).
- `mistral`: text, then `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` form.

Streaming is safe before it is fast: an answer that may be a call is held back until it is known
(hermes: its closing tag; the others: the end of the answer), so a call is never split across
deltas, never lost, and content that only looked like a call's start comes out as content.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


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


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _named_call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("parameters" if arguments_key == "arguments" else "arguments", {}))
    return ToolCall(obj["name"], _arguments_text(args))


def _json_values(text: str, separator: str = "") -> list[Any] | None:
    """The JSON values `text` is made of (between them: whitespace and `separator`), else None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


# -- hermes --------------------------------------------------------------------------------------
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_LISTING = "You may call one or more functions to assist with the user query. Here are the available tools:\n" \
           "<tools>\n{tools}\n</tools>\n"


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
        return _named_call(json.loads(body))
    except ValueError:
        return None


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

    def flush(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        return rest, []


# -- llama3_json, pythonic, mistral ----------------------------------------------------------------
def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    values = _json_values(body, ";") if body.startswith("{") else None
    calls = [_named_call(v, "parameters") for v in values or ()]
    if not calls or None in calls:
        return text, []
    return None, calls


def parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        calls = [_pythonic_call(node) for node in tree.elts] if isinstance(tree, ast.List) else []
    except (SyntaxError, ValueError, TypeError):
        return text, []
    return (None, calls) if calls else (text, [])


def _pythonic_call(node: ast.AST) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call by keyword arguments")
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return text, []
    content, body = text[:start].strip() or None, text[start + len(MISTRAL_CALLS):]
    calls = _mistral_array(body) if body.lstrip().startswith("[") else _mistral_named(body)
    return (content, calls) if calls else (text, [])


def _mistral_array(body: str) -> list[ToolCall] | None:
    values = _json_values(body.replace(MISTRAL_CALLS, " "))
    calls = [_named_call(item) for value in values or () for item in (value if isinstance(value, list) else [value])]
    return calls if calls and None not in calls else None


def _mistral_named(body: str) -> list[ToolCall] | None:
    """`name[ARGS]{...}`, repeated (each after its own `[TOOL_CALLS]`, or not)."""
    calls, decoder, i = [], json.JSONDecoder(), 0
    body = body.replace(MISTRAL_CALLS, " ")
    while i < len(body.rstrip()):
        match = _MISTRAL_NAMED.match(body, i)
        if match is None:
            return None
        try:
            args, i = decoder.raw_decode(body, match.end())
        except ValueError:
            return None
        calls.append(ToolCall(match.group(1), _arguments_text(args)))
    return calls or None


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    starts: tuple[str, ...]  # what a call's text starts with
    anywhere: bool  # a call may follow content (else only the whole answer is calls)
    instruction: str  # how to call, after the listing of the tools
    keeps_special_tokens: bool = False  # its markers are special tokens: the detokenizer must keep them

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return _PARSE[self.name](text)

    def streamer(self):
        return HermesStreamParser() if self.name == "hermes" else HeldCallStream(self)

    def system_prompt(self, functions: list[dict]) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
        return _LISTING.format(tools=listed) + self.instruction

    def write_calls(self, calls: list[dict]) -> str:
        """An assistant turn's earlier calls ({"name", "arguments"} with parsed arguments) as it writes them."""
        if self.name == "hermes":
            return "".join(f"{TOOL_CALL_OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}" for c in calls)
        if self.name == "llama3_json":
            return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                             for c in calls)
        if self.name == "pythonic":
            return "[" + ", ".join(f"{c['name']}(" + ", ".join(f"{k}={v!r}" for k, v in _as_dict(c).items()) + ")"
                                   for c in calls) + "]"
        return MISTRAL_CALLS + json.dumps(calls, ensure_ascii=False)


def _as_dict(call: dict) -> dict:
    return call["arguments"] if isinstance(call["arguments"], dict) else {}


_PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "pythonic": parse_pythonic,
          "mistral": parse_mistral}

TOOL_CALL_FORMATS = {
    "hermes": ToolCallFormat("hermes", (TOOL_CALL_OPEN,), True,
                             "For each function call, return a JSON object with the function name and arguments "
                             "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                             "\"arguments\": <args-json-object>}\n</tool_call>"),
    "llama3_json": ToolCallFormat("llama3_json", ("{", "<|python_tag|>"), False,
                                  "To call a function, respond only with a JSON object of the form "
                                  "{\"name\": function name, \"parameters\": dictionary of argument name and its "
                                  "value}; several calls are separated by ';'."),
    "pythonic": ToolCallFormat("pythonic", ("[", "<|python_start|>"), False,
                               "To call functions, respond only with a Python list of calls: "
                               "[func_name1(param_name1=value1, param_name2=value2), func_name2(param=value)]"),
    "mistral": ToolCallFormat("mistral", (MISTRAL_CALLS,), True,
                              "To call functions, write [TOOL_CALLS] and then a JSON array of "
                              "{\"name\": function name, \"arguments\": {argument: value}} objects.",
                              keeps_special_tokens=True),
}


class HeldCallStream:
    """Streaming for formats whose calls end with the answer: text that may start a call is held
    back, and once a call has started, everything after it is held and parsed at the end."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.buffer = ""
        self.calling = False  # a call's start was seen: hold the rest
        self.decided = False  # (calls only at the start) the answer is known to be content
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        if self.calling or self.decided and not self.fmt.anywhere:
            return self._release() if not self.calling else ("", [])
        if self.fmt.anywhere:
            start = min((i for i in (self.buffer.find(s) for s in self.fmt.starts) if i >= 0), default=-1)
            if start >= 0:
                self.calling = True
                text, self.buffer = self.buffer[:start], self.buffer[start:]
                return text, []
            keep = max(partial_suffix(self.buffer, s) for s in self.fmt.starts)
            text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            return text, []
        head = self.buffer.lstrip()
        if any(head.startswith(s) for s in self.fmt.starts):
            self.calling = True
            return "", []
        if head and not any(s.startswith(head) for s in self.fmt.starts):
            self.decided = True
            return self._release()
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        text, self.buffer = self.buffer, ""
        if not self.calling:
            return text, []
        content, calls = self.fmt.parse(text)
        self.num_calls += len(calls)
        return content or "", calls

    def _release(self) -> tuple[str, list[ToolCall]]:
        text, self.buffer = self.buffer, ""
        return text, []


def tool_call_format(name: str | None) -> ToolCallFormat:
    if name is None:
        return TOOL_CALL_FORMATS["hermes"]
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(TOOL_CALL_FORMATS)}")
    return TOOL_CALL_FORMATS[name]
