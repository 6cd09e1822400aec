"""Bounds on what one request may ask for, shared by every API family (OpenAI's `/v1` bodies in
openai/protocol.py, Ollama's `/api` bodies in ollama/common.py), so that an adversarial body is
refused at validation, before it costs tokenizing, compiling a grammar or generating. Each check
raises ValueError naming the field; both families turn it into a 400 with that message."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

MAX_N = 128  # choices per prompt: OpenAI's own bound (vLLM has none)
MAX_STOP = 64  # stop strings (OpenAI takes 4, vLLM has no bound; each is checked on every step)
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries (OpenAI takes 300)
MAX_PROMPTS = 2048  # prompts in one completions request (as OpenAI bounds an embeddings input list)
# Nesting of the free-form JSON values (schemas, tools, options, template arguments), which reach
# recursive code: the grammar compiler, the chat template. Typed fields are bounded by their type.
# xgrammar's JSON-schema conversion grows with the cube of the nesting: a schema 64 levels deep
# converts in ~0.03 s, 300 levels in ~3 s.
MAX_DEPTH = 64
# Values (keys and items, at any depth) in one such value: the grammar compiler's time grows with
# the schema's size (a 5,000-property object, ~25,000 values, compiled in ~2-4 s here). 20,000
# takes an object of ~4,000 simply typed properties, or ~6,500 without a `required` list.
MAX_JSON_VALUES = 20_000
# Ollama's `template` field: real TEMPLATEs are a few KB; Jinja compiles 32 KB of nested ranges in ~0.5 s.
MAX_TEMPLATE_CHARS = 32 * 1024
# What a chat template is rendered with (tokenizer.apply_chat_template); `chat_template_kwargs`
# adds arguments beside these and may not replace them.
TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "bos_token", "eos_token")
NESTED_TOO_DEEPLY = "the body is not valid JSON: it is nested too deeply"


def _over(value: Any, max_depth: int, max_values: int) -> str | None:
    """What of `value` passes the bounds ("depth" or "values"), else None. Iterative (no
    recursion), and it stops at the first excess, so a huge value costs no more than the bound."""
    count, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
            count += len(item)  # the keys
        elif isinstance(item, list):
            children = item
        else:
            continue
        if level > max_depth:
            return "depth"
        count += len(item)
        if count > max_values:
            return "values"
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return None


def check_depth(value: Any, field: str) -> Any:
    """A free-form value whose size another bound already covers: only its nesting is checked."""
    if _over(value, MAX_DEPTH, sys.maxsize) == "depth":
        raise ValueError(f"{field} is nested more than {MAX_DEPTH} levels deep")
    return value


def check_json(value: Any, field: str) -> Any:
    """A free-form JSON value (a schema, tools, options): at most MAX_DEPTH levels deep and
    MAX_JSON_VALUES values (an object's keys count), so that what walks or compiles it stays fast."""
    over = _over(value, MAX_DEPTH, MAX_JSON_VALUES)
    if over == "depth":
        raise ValueError(f"{field} is nested more than {MAX_DEPTH} levels deep")
    if over == "values":
        raise ValueError(f"{field} has more than {MAX_JSON_VALUES} JSON values (keys and items), the limit")
    return value


def check_schema(value: Any, field: str) -> Any:
    """A JSON schema given as an object or as JSON text (guided_json's string form), bounded as
    check_json. Text that does not parse is left to the grammar builder, which names the error."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except RecursionError:
            raise ValueError(f"{field} is nested more than {MAX_DEPTH} levels deep") from None
        except ValueError:
            return value
        check_json(parsed, field)
        return value
    return check_json(value, field)


def check_count(value: Any, field: str, limit: int, what: str) -> Any:
    """Refuses an over-long list / object before pydantic validates each of its items."""
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise ValueError(f"{field} may have at most {limit} {what}, got {len(value)}")
    return value


def check_stop(value: Any, field: str = "stop") -> Any:
    return check_count(value, field, MAX_STOP, "strings")


def check_stop_token_ids(value: Any, field: str = "stop_token_ids") -> Any:
    return check_count(value, field, MAX_STOP_TOKEN_IDS, "token ids")


def check_template_kwargs(value: Any, field: str = "chat_template_kwargs") -> Any:
    """Extra chat-template arguments: bounded like any free-form value, and none that replaces an
    argument the server renders the template with (`messages` would be passed twice)."""
    check_json(value, field)
    if isinstance(value, Mapping):
        taken = [key for key in TEMPLATE_ARGUMENTS if key in value]
        if taken:
            raise ValueError(f"{field} may not set {', '.join(repr(k) for k in taken)}: the server passes "
                             f"{', '.join(TEMPLATE_ARGUMENTS)} to the chat template itself")
    return value


def check_template(value: Any, field: str = "template") -> Any:
    if isinstance(value, str) and len(value) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{field} has {len(value)} characters, more than the limit of {MAX_TEMPLATE_CHARS}")
    return value


def parse_json_object(raw: bytes) -> dict:
    """A request body that must be a JSON object (ValueError otherwise, as parse_json_body)."""
    data = parse_json_body(raw)
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    return data


def parse_json_body(raw: bytes) -> Any:
    """A request body's JSON ({} for an empty body). ValueError for what does not parse, including
    nesting past Python's recursion limit (a RecursionError from the parser, else a 500)."""
    try:
        return json.loads(raw) if raw.strip() else {}
    except RecursionError:
        raise ValueError(NESTED_TOO_DEEPLY) from None
    except ValueError as e:
        raise ValueError(f"the body is not valid JSON: {e}") from None
