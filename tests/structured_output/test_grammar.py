"""Constraints → xgrammar grammars: what is accepted, and errors that name the bad field."""

from __future__ import annotations

import pytest

from constraint_sets import JSON_SCHEMAS, REGEXES
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.structured_output import build_grammar, constraint_key


def test_every_shipped_constraint_builds():
    for schema in JSON_SCHEMAS:
        build_grammar(StructuredOutputsParams(json=schema))
    for regex in REGEXES:
        build_grammar(StructuredOutputsParams(regex=regex))
    build_grammar(StructuredOutputsParams(choice=['say "hi"', "back\\slash", "naïve"]))
    build_grammar(StructuredOutputsParams(grammar='root ::= "a" digit+\ndigit ::= [0-9]'))
    build_grammar(StructuredOutputsParams(json_object=True))


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "objekt"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="[0-9"), "structured_outputs.regex"),
    (dict(grammar='root ::= "a" | '), "structured_outputs.grammar"),
])
def test_bad_constraints_name_their_field(spec, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_grammar(StructuredOutputsParams(**spec))


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_equal_constraints_share_a_key():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert constraint_key(a) == constraint_key(b)
    assert constraint_key(a) != constraint_key(StructuredOutputsParams(json={"type": "object"}))
    assert constraint_key(StructuredOutputsParams(regex="a")) != constraint_key(StructuredOutputsParams(grammar="a"))


def test_bounded_json_strings_reject_control_characters():
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", '"', "\x05", "</s>"], stop_token_ids=[4]))
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    compiled = compiler.compile_grammar(build_grammar(StructuredOutputsParams(json=schema)))
    assert xgr.GrammarMatcher(compiled).accept_string('{"s": "ab"}')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"s": "a\x05')
