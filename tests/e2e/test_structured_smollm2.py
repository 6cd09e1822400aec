"""Structured outputs on the real SmolLM2: with sampling on, every constrained answer parses
and validates, over 20 JSON schemas and 10 regexes, in one batch with free requests."""

from __future__ import annotations

import json
import re

import pytest

from constraint_sets import JSON_SCHEMAS, REGEXES
from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams as SO

pytestmark = pytest.mark.slow

FREE_PROMPTS = ["Write a haiku about the sea.", "Describe a cat.", "What is Python?", "Say something kind."]


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return LLM(model="smollm2", kv_cache_memory=0.5)


def _chat(llm: LLM, text: str) -> dict:
    return {"prompt_token_ids": llm.engine.tokenizer.encode_chat([{"role": "user", "content": text}])}


def test_every_constrained_output_parses_and_validates(smol):
    jsonschema = pytest.importorskip("jsonschema")
    prompts, params = [], []
    for i, schema in enumerate(JSON_SCHEMAS):
        prompts.append(_chat(smol, f"Reply with a JSON value that follows this schema: {json.dumps(schema)}"))
        params.append(SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=160, structured_outputs=SO(json=schema)))
    for i, regex in enumerate(REGEXES):
        prompts.append(_chat(smol, f"Give one example of text matching the pattern {regex}"))
        params.append(SamplingParams(temperature=0.8, seed=100 + i, max_tokens=40, structured_outputs=SO(regex=regex)))
    for i, text in enumerate(FREE_PROMPTS):
        prompts.append(_chat(smol, text))
        params.append(SamplingParams(temperature=0.8, seed=200 + i, max_tokens=32))
    outs = smol.generate(prompts, params, use_tqdm=False)

    n_json = len(JSON_SCHEMAS)
    for schema, out in zip(JSON_SCHEMAS, outs[:n_json]):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", f"{schema}: cut off: {text!r}"
        jsonschema.validate(json.loads(text), schema)
    for regex, out in zip(REGEXES, outs[n_json:n_json + len(REGEXES)]):
        assert out.outputs[0].finish_reason == "stop", f"{regex}: cut off: {out.outputs[0].text!r}"
        assert re.fullmatch(regex, out.outputs[0].text), (regex, out.outputs[0].text)
    for out in outs[-len(FREE_PROMPTS):]:
        assert out.outputs[0].text  # free requests ran beside them
    assert smol.engine.core.kv_manager.usage() == 0.0
