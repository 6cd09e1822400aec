"""OpenAI-compatible request and response bodies (pydantic), plus vLLM's extension fields."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, field_validator

# The bounds on what one request may ask for (n, stop, nesting, sizes) live in input_limits.py,
# shared with Ollama's bodies (ollama/common.py): one validation path for every API family.
from pagoda.entrypoints.input_limits import (
    MAX_LOGIT_BIAS, MAX_N, MAX_PROMPTS, check_count, check_depth, check_json, check_schema, check_stop,
    check_stop_token_ids, check_template_kwargs,
)
from pagoda.sampling_params import INT64_MAX, SamplingParams, StructuredOutputsParams
from pagoda.structured_output.grammar import validate_structured_outputs

# Every integer field: the engine puts these in int64 tensors (a larger top_k overflowed there).
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBase(BaseModel):
    # Unknown fields are ignored, as OpenAI does. NaN and Infinity (which Python's JSON parser
    # reads) are refused: no sampling parameter means anything with them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIBase):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBase):
    name: str | None = None
    description: str | None = None
    # `schema` clashes with a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBase):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class RequestBody(OpenAIBase):
    """A route's whole body (not a nested object)."""


class SamplingFields(RequestBody):
    """Fields shared by completions and chat (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Int64 = 0
    cache_salt: str | None = None
    speculative: bool = True  # pagoda: false opts the request out of speculative decoding
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields and its newer object.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # Beam search (vLLM's; beam_requests.py): width best_of, else n; the best n beams are the choices.
    use_beam_search: bool = False
    best_of: Int64 | None = None
    length_penalty: float = 1.0
    early_stopping: bool = False

    @field_validator("n")
    @classmethod
    def _n_bounded(cls, n: int) -> int:
        if n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {n}")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_bounded(cls, stop: Any) -> Any:
        return check_stop(stop)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids_bounded(cls, ids: Any) -> Any:
        return check_stop_token_ids(ids)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_bounded(cls, bias: Any) -> Any:
        return check_count(bias, "logit_bias", MAX_LOGIT_BIAS, "entries")

    @field_validator("response_format", "guided_json", "structured_outputs", mode="before")
    @classmethod
    def _bounded_schema(cls, value: Any, info) -> Any:
        if info.field_name == "structured_outputs" and isinstance(value, dict):  # {"json": schema text}
            check_schema(value.get("json"), "structured_outputs.json")
        return check_schema(value, info.field_name)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint this request asks for (None: free text). ValueError names the field."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            given.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.json_schema)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append((name, _structured(name, {key: value})))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", _structured("structured_outputs", self.structured_outputs)))
        if len(given) > 1:
            raise ValueError(f"{given[1][0]} cannot be combined with {given[0][0]}: give one constraint at most")
        if not given:
            return None
        name, params = given[0]
        validate_structured_outputs(params, name)
        return params

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's own (generation_defaults.py) for the fields the request leaves unset."""
        defaults = defaults or {}

        def given(value, name: str, fallback):
            return value if value is not None else defaults.get(name, fallback)

        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        return SamplingParams(
            n=self.n,
            temperature=given(self.temperature, "temperature", 1.0),
            top_p=given(self.top_p, "top_p", 1.0),
            top_k=given(self.top_k, "top_k", 0),
            min_p=given(self.min_p, "min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=given(self.repetition_penalty, "repetition_penalty", 1.0),
            seed=given(self.seed, "seed", None),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            speculative=self.speculative,
        )


_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object", "whitespace_flexible"}


def _structured(field_name: str, spec: dict[str, Any]) -> StructuredOutputsParams:
    if not isinstance(spec, dict):
        raise ValueError(f"{field_name} must be an object")
    unknown = set(spec) - _STRUCTURED_KEYS
    if unknown:
        raise ValueError(f"{field_name} has unknown keys {sorted(unknown)}; use {sorted(_STRUCTURED_KEYS)}")
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as e:
        raise ValueError(f"{field_name} is invalid: {e}") from None


def _prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A completions prompt: a string, strings, token ids, or lists of token ids.

    Checked by hand rather than as a pydantic union: the union validated a list of 8M token ids
    in 6 s, and a list with one string among them in 90 s (one error per item and member)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(_PROMPT_FORMS)
    if value and all(type(x) is int for x in value):
        return value
    check_count(value, "prompt", MAX_PROMPTS, "prompts")
    if all(isinstance(x, str) for x in value):
        return value
    if all(isinstance(x, list) and all(type(t) is int for t in x) for x in value):
        return value
    raise ValueError(_PROMPT_FORMS)


_PROMPT_FORMS = "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists"
Prompt = Annotated[str | list[str] | list[int] | list[list[int]],
                   PlainValidator(_prompt, json_schema_input_type=str | list[str] | list[Int64] | list[list[Int64]])]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(OpenAIBase):
    """One part of a message's content: `text`, or for a vision-language model `image_url`
    ({"url": "data:image/png;base64,..."}; chat_images.py); others get a 400."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None


class ToolCallFunction(OpenAIBase):
    name: str
    arguments: str | dict[str, Any] | None = None  # OpenAI sends JSON text


class MessageToolCall(OpenAIBase):
    """A call an earlier assistant turn made (chat templates read function.name / arguments)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIBase):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this answers

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _shallow(cls, value: Any) -> Any:
        return check_depth(value, "tool_calls")

    def text(self) -> str:
        """The content as one string (text parts joined). ValueError for a part that is not text
        (image parts: chat_images.message_content)."""
        if not isinstance(self.content, list):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r} is not supported; only 'text'")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True

    @field_validator("tools", "tool_choice", mode="before")
    @classmethod
    def _bounded_tools(cls, value: Any, info) -> Any:
        return check_json(value, info.field_name)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _bounded_kwargs(cls, value: Any) -> Any:
        return check_template_kwargs(value)


class SessionCreateRequest(SamplingFields):
    """POST /v1/sessions: the system prompt, and sampling fields that become the session's
    defaults (each message may override them)."""

    system: str | None = None
    messages: list[ChatMessage] | None = None  # an earlier conversation to go on from (user / assistant turns)
    overflow: Literal["truncate", "summarize"] = "truncate"  # when the history outgrows the context


class SessionMessageRequest(SamplingFields):
    """POST /v1/sessions/{id}/messages: the user's next message."""

    content: str
    max_completion_tokens: Int64 | None = None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[Int64]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict | None = None


def now() -> int:
    return int(time.time())


# -- validation errors → one readable message -----------------------------------------------------
# pydantic names a union's member in the error location ('str', 'list[ContentPart]', ...): not a
# field, so left out of `param`.
_UNION_TAG = re.compile(r"^[\w-]+\[.*\]$|^(str|int|float|bool|none|bytes|dict|list|any)$|^[A-Z]\w*$")
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def _field_path(loc: Sequence[Any]) -> str:
    """pydantic's error location → the field's dotted path (`messages.0.role`); '' for the body."""
    parts = [str(x) for x in loc[1:] if not (isinstance(x, str) and _UNION_TAG.match(x))] if loc[:1] == ("body",) \
        else [str(x) for x in loc]
    return ".".join(parts)


def _body_message(error: dict) -> str:
    """The message for an error about the body as a whole."""
    kind, given = error.get("type"), error.get("input")
    if kind == "missing":
        return "the request body is missing: send a JSON object"
    if isinstance(given, (bytes, bytearray)):
        return "the request body must be a JSON object, sent with Content-Type: application/json"
    if kind in ("model_attributes_type", "model_type", "dict_type"):
        return f"the request body must be a JSON object, got {_JSON_TYPES.get(type(given), 'something else')}"
    return _plain(error["msg"])


def _plain(message: str) -> str:
    return message.removeprefix("Value error, ")


def describe_validation_errors(errors: Sequence[dict]) -> tuple[str, str | None]:
    """FastAPI's / pydantic's errors for a request → (message, param) for one OpenAI-style 400.

    The message names the field and says what it should be; it never carries the input back (a
    10 MB prompt) nor a Python repr. Of the first field's errors, the most specific (deepest)
    location is reported; a union's alternatives for it are joined with "or"."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first["loc"][-1] if isinstance(first["loc"][-1], int) else None
        detail = (first.get("ctx") or {}).get("error", "JSON decode error")
        return f"the body is not valid JSON: {detail}" + (f" (at character {where})" if where is not None else ""), None
    paths = [_field_path(e.get("loc", ())) for e in errors]
    top = paths[0].split(".")[0]
    chosen = max((p for p in paths if p.split(".")[0] == top), key=lambda p: p.count(".") + bool(p))
    if not chosen:
        return _body_message(first), None
    messages = list(dict.fromkeys(_plain(e["msg"]) for e, p in zip(errors, paths) if p == chosen))
    text = " or ".join([messages[0]] + [m.removeprefix("Input should be ") for m in messages[1:3]])
    named = text.startswith(chosen.rsplit(".", 1)[-1] + " ") or text.startswith(chosen + " ")
    return (text if named else f"{chosen}: {text}"), chosen
