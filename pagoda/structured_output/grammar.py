"""StructuredOutputsParams → xgrammar Grammar, with errors that name the bad field."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from pagoda.sampling_params import StructuredOutputsParams

# JSON is written compactly with json.dumps' separators unless whitespace_flexible is set: a
# small model given free whitespace can spend its whole budget on newlines.
_SEPARATORS = (", ", ": ")
_FLEXIBLE_MAX_WHITESPACE = 8
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _schema_text(params: StructuredOutputsParams, name: str = "structured_outputs.json") -> str:
    if isinstance(params.json, str):
        try:
            json.loads(params.json)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
        return params.json
    return json.dumps(params.json)


# xgrammar (0.2.x) writes the characters of a length-bounded string (minLength / maxLength) as
# [^"\\\r\n], which admits control characters that JSON forbids; unbounded strings exclude them.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def _json_grammar(xgr, schema: str, params: StructuredOutputsParams, strict: bool):
    if params.whitespace_flexible:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=strict,
                                               max_whitespace_cnt=_FLEXIBLE_MAX_WHITESPACE)
    else:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=_SEPARATORS, strict_mode=strict)
    ebnf = str(grammar)
    if _LOOSE_STRING_CHAR in ebnf:
        grammar = xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
    return grammar


def _choice_ebnf(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes, so json.dumps quotes each choice safely.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams, name: str | None = None):
    """The xgrammar Grammar for a constraint. Raises ValueError naming the field on bad input
    (`name`, default structured_outputs.<kind>: the server passes the request field it came from)."""
    import xgrammar as xgr

    kind = params.kind
    name = name or f"structured_outputs.{kind}"
    try:
        if kind == "json":
            return _json_grammar(xgr, _schema_text(params, name), params, strict=True)
        if kind == "json_object":
            return _json_grammar(xgr, '{"type": "object"}', params, strict=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError with a C++ source location in front
        message = _XGRAMMAR_PREFIX.sub("", str(e)).strip()
        raise ValueError(f"{name} is invalid: {message}") from None


# Constraints that built once: the server checks a request's constraint off the event loop, then
# the engine checks it again on the loop as it takes the request (LLMEngine.prepare_request); a
# schema xgrammar takes seconds over must not cost that time twice, the second time on the loop.
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
