"""StructuredOutputsParams → llguidance grammar, with errors that name the bad field.

llguidance (the backend vLLM calls "guidance") is a 3 MB wheel with no dependencies; xgrammar,
used before, pulls triton (~1 GB installed) into a CPU-first engine.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from pagoda.sampling_params import StructuredOutputsParams

# JSON is written compactly with json.dumps' separators unless whitespace_flexible is set: a
# small model given free whitespace can spend its whole budget on newlines, so even flexible
# whitespace comes in runs of at most 8 characters.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FLEXIBLE_JSON = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,8}"}
# Keywords llguidance does not implement (not, if/then, uniqueItems, unknown formats) are
# ignored rather than refused, as xgrammar did: a schema accepted before stays accepted.
_LENIENT = {"lenient": True}

# Bounds on the work one grammar may cost (llguidance's defaults, but for the lexer's states,
# which cost 1-2 kB each, and the grammar's size): a grammar past them is refused when
# validated, and one that exhausts a step's fuel while generating stops its request. Each fuel
# bound keeps a grammar's work per step to milliseconds (benchmarks/code_notes.md).
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2_000,  # branching of one Earley row
    initial_lexer_fuel=1_000_000,  # building the lexer's regexes
    step_lexer_fuel=200_000,  # lexer work of one token mask
    step_max_items=50_000,  # Earley items of one token mask
    max_lexer_states=50_000,
    max_grammar_size=200_000,
    verbose_errors=False,  # errors go back to clients: no parser-state dumps
)

_SOURCE_LINE = re.compile(r"^\s*(\d+ \|.*|\^)\s*$")  # "  1 | start: /[0-9/" and the caret line under it
_POSITION = re.compile(r"^at \d+\(\d+\): ")

# Keys whose values are data, not subschemas: an object inside them is left as it is.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def _schema_text(params: StructuredOutputsParams, name: str = "structured_outputs.json") -> str:
    if isinstance(params.json, str):
        try:
            json.loads(params.json)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
        return params.json
    return json.dumps(params.json)


def _close_objects(schema: Any) -> Any:
    """Make every object with listed properties take no others, and every tuple (prefixItems)
    no more items, unless the schema says otherwise (in place): strict mode, as OpenAI's and
    xgrammar's; llguidance follows JSON Schema, where both default to allowed."""
    stack = [schema]
    while stack:  # iterative: a deep schema costs no Python recursion
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYS)
            if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            if "prefixItems" in node and "items" not in node:
                node["items"] = False
    return schema


def _json_grammar(schema: Any, params: StructuredOutputsParams) -> str:
    layout = _FLEXIBLE_JSON if params.whitespace_flexible else _COMPACT_JSON
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**layout, **_LENIENT})


def _choice_grammar(choices: list[str]) -> str:
    # Lark string literals take JSON's escapes, so json.dumps quotes each choice safely.
    literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return llguidance.LLMatcher.grammar_from_lark("start: " + literals)


def _regex_grammar(regex: str) -> str:
    # \d, \w and \s are ASCII classes ("dws"), as xgrammar's were, not Unicode ones.
    return llguidance.LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(regex, "dws") + "/")


def _grammar(params: StructuredOutputsParams, schema: Any) -> str:
    kind = params.kind
    if kind == "json":
        return _json_grammar(_close_objects(schema), params)
    if kind == "json_object":
        return _json_grammar({"type": "object"}, params)
    if kind == "regex":
        return _regex_grammar(params.regex)
    if kind == "choice":
        return _choice_grammar(params.choice)
    # GBNF (llama.cpp's EBNF, root rule `root`) is converted to Lark; Lark (rule `start`) passes.
    return llguidance.grammar_from("grammar", params.grammar)


def build_grammar(params: StructuredOutputsParams, name: str | None = None) -> str:
    """The llguidance grammar (serialized) for a constraint, validated. Raises ValueError naming
    the field on bad input (`name`, default structured_outputs.<kind>: the server passes the
    request field it came from)."""
    name = name or f"structured_outputs.{params.kind}"
    schema = json.loads(_schema_text(params, name)) if params.kind == "json" else None
    try:
        grammar = _grammar(params, schema)
    except Exception as e:  # the GBNF converter's ValueError, a RecursionError on deep nesting
        raise ValueError(f"{name} is invalid: {_one_line(str(e))}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=LIMITS)
    if error:
        raise ValueError(f"{name} is invalid: {_one_line(error)}")
    return grammar


def _one_line(message: str, limit: int = 400) -> str:
    """llguidance's messages span lines, with the internal grammar's source and carets under
    it: the message alone, on one line, bounded."""
    lines = [line for line in message.splitlines() if not _SOURCE_LINE.match(line)]
    text = _POSITION.sub("", " ".join(" ".join(lines).split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Constraints that built once: the server checks a request's constraint off the event loop, then
# the engine checks it again on the loop as it takes the request (InputProcessor.prepare_request); a
# wide schema within the input limits takes a good part of a second, which must not be paid twice,
# the second time on the loop.
_VALID_CACHE_SIZE = 256
_valid: OrderedDict[tuple, None] = OrderedDict()
_valid_lock = threading.Lock()


def validate_structured_outputs(params: StructuredOutputsParams | None, name: str | None = None) -> None:
    """Check a constraint on the front end, so a bad schema is an HTTP 400, not an engine error."""
    if params is None:
        return
    key = constraint_key(params)
    with _valid_lock:
        if key in _valid:
            _valid.move_to_end(key)
            return
    build_grammar(params, name)
    with _valid_lock:
        _valid[key] = None
        if len(_valid) > _VALID_CACHE_SIZE:
            _valid.popitem(last=False)


def constraint_key(params: StructuredOutputsParams) -> tuple:
    """A hashable key: equal constraints share one compiled grammar."""
    kind = params.kind
    if kind == "json":
        spec = _schema_text(params) if isinstance(params.json, str) else json.dumps(params.json, sort_keys=True)
    elif kind == "choice":
        spec = tuple(params.choice)
    elif kind == "json_object":
        spec = None
    else:
        spec = getattr(params, kind)
    return kind, spec, params.whitespace_flexible
