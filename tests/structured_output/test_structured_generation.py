"""Constrained decoding in the engine, on the tiny random model: every output obeys its
constraint, whatever the batch; free requests beside constrained ones are unaffected."""

from __future__ import annotations

import json
import re

import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams as SO

PROMPTS = ["Hello", "The quick brown fox", "Paris is", "def main():"]


def _sample(so: SO | None, seed: int, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=so)


def test_regex_choice_and_grammar_hold_in_a_mixed_batch(tiny_llm):
    regex = r"[a-z]{2,5}-[0-9]{2}"
    choices = ["alpha", "beta", "gamma delta"]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    params = [_sample(SO(regex=regex), 1), _sample(SO(choice=choices), 2), _sample(SO(grammar=grammar), 3), _sample(None, 4, 20)]
    outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(regex, texts[0]), texts[0]
    assert texts[1] in choices
    assert re.fullmatch(r"\((\d|x)(,(\d|x))*\)", texts[2]), texts[2]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:2])
    # The free request gives the same tokens as when it runs alone.
    alone = tiny_llm.generate([PROMPTS[3]], _sample(None, 4, 20), use_tqdm=False)[0]
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids


def test_json_schema_output_parses_and_validates(tiny_llm):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}, "required": ["name", "n", "tags"]}
    outs = tiny_llm.generate(PROMPTS, [_sample(SO(json=schema), s, 120) for s in range(4)], use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_json_object_and_greedy(tiny_llm):
    outs = tiny_llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=120, structured_outputs=SO(json_object=True,
                             whitespace_flexible=True)), use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)
        else:  # cut off by max_tokens: still a prefix of an object
            assert o.outputs[0].text.lstrip().startswith("{")


def test_constraint_survives_preemption(tiny_llama):
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    small = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=10 * per_block / 2**30)
    regex = r"([a-z]{3} ){10,14}[0-9]{4}"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=70, structured_outputs=SO(regex=regex)) for i in range(6)]
    outs = small.generate(["Once upon a time there was a little engine"] * 6, params, use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions_total > 0
    for o in outs:
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
    assert small.engine.core.kv_manager.usage() == 0.0


def test_equal_constraints_compile_once_and_abort_frees_blocks(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)
    engine = llm.engine
    so = SO(regex=r"[0-9]{40}")
    for i in range(3):
        engine.add_request(f"r{i}", "Hello", SamplingParams(max_tokens=40, structured_outputs=so))
    for _ in range(3):
        engine.step()
    assert engine.core.structured_outputs.num_compiled == 1
    engine.abort_request("r0")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert re.fullmatch(r"[0-9]{40}", out.outputs[0].text)
    assert engine.core.kv_manager.usage() == 0.0


def test_bad_constraint_is_a_value_error(tiny_llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is invalid"):
        tiny_llm.generate(["x"], SamplingParams(structured_outputs=SO(regex="(unclosed")), use_tqdm=False)
    out = tiny_llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3  # the engine serves on
