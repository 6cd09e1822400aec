"""Constraints → llguidance grammars: what is accepted, and errors that name the bad field."""

from __future__ import annotations

import pytest

from constraint_sets import JSON_SCHEMAS, REGEXES
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.structured_output import build_grammar, compile_grammar, constraint_key
from pagoda.structured_output.manager import load_tokenizer
from pagoda.tokenizer import Tokenizer


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
    (dict(grammar='root ::= "a" digit'), "structured_outputs.grammar"),  # no rule `digit`
    (dict(grammar='root ::= ("a"'), "structured_outputs.grammar"),
    (dict(grammar="start: foo"), "structured_outputs.grammar"),  # Lark
])
def test_bad_constraints_name_their_field(spec, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + " is (invalid|not valid JSON)") as raised:
        build_grammar(StructuredOutputsParams(**spec))
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 500  # one line, for an HTTP 400


def test_unimplemented_schema_keywords_are_ignored_as_before():
    # xgrammar ignored what it did not implement; llguidance is told to (lenient), so such a
    # schema stays accepted.
    build_grammar(StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}))
    build_grammar(StructuredOutputsParams(json={"type": "string", "format": "made-up"}))


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


@pytest.fixture(scope="module")
def accepts(tiny_llama):
    """accepts(params, text): whether the compiled constraint takes exactly this text."""
    tokenizer = Tokenizer(tiny_llama)
    ll_tokenizer = load_tokenizer(tiny_llama, tokenizer.vocab_size, tokenizer.eos_token_ids)

    def check(params: StructuredOutputsParams, text: str) -> bool:
        matcher = compile_grammar(ll_tokenizer, params).matcher.deep_copy()
        tokens = ll_tokenizer.tokenize_str(text)
        return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and matcher.is_accepting()

    return check


def test_json_strings_reject_control_characters(accepts):
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    assert accepts(StructuredOutputsParams(json=schema), '{"s": "ab"}')
    assert not accepts(StructuredOutputsParams(json=schema), '{"s": "a\x05"}')


def test_json_is_strict_and_compact_unless_flexible(accepts):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "t": {"type": "array", "prefixItems": [{"const": 1}]},
                                               "c": {"const": {"properties": 1}}}}
    strict = StructuredOutputsParams(json=schema)
    assert accepts(strict, '{"x": 1, "t": [1], "c": {"properties": 1}}')  # a const object is data, left as it is
    assert not accepts(strict, '{"x": 1, "y": 2}')  # no properties beyond those listed
    assert not accepts(strict, '{"t": [1, 1]}')  # no items beyond prefixItems
    assert not accepts(strict, '{"x":1}') and not accepts(strict, '{ "x": 1}')  # json.dumps' separators only
    assert accepts(StructuredOutputsParams(json={**schema, "additionalProperties": True}), '{"x": 1, "y": 2}')
    flexible = StructuredOutputsParams(json=schema, whitespace_flexible=True)
    assert accepts(flexible, '{"x":1}') and accepts(flexible, '{\n  "x" : 1\n}')
    assert not accepts(flexible, '{"x":' + " " * 9 + "1}")  # whitespace runs are bounded
    assert accepts(StructuredOutputsParams(json_object=True), '{"a": [1, {"b": null}]}')


def test_regex_classes_are_ascii_and_choices_are_literal(accepts):
    assert accepts(StructuredOutputsParams(regex=r"\d{2}\w"), "42_")
    assert not accepts(StructuredOutputsParams(regex=r"\d"), "\u0663")  # ARABIC-INDIC DIGIT THREE
    choices = StructuredOutputsParams(choice=['say "hi"', "back\\slash"])
    assert accepts(choices, 'say "hi"') and accepts(choices, "back\\slash") and not accepts(choices, "say")
    gbnf = StructuredOutputsParams(grammar='root ::= num (", " num){2}\nnum ::= [1-9]')
    assert accepts(gbnf, "1, 2, 3") and not accepts(gbnf, "1, 2")
