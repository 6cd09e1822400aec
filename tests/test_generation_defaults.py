"""A model's own sampling defaults (generation_config.json; a store model's PARAMETERs): used
for what a request leaves unset, overridden by what it sets, ignored with generation_config="vllm"."""

from __future__ import annotations

import json
import shutil

import pytest

from pagoda import LLM, SamplingParams
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.generation_defaults import sampling_defaults


@pytest.fixture(scope="module")
def greedy_five(tiny_llama, tmp_path_factory):
    """The tiny model whose authors recommend greedy decoding and five new tokens."""
    out = tmp_path_factory.mktemp("gen-defaults")
    for f in tiny_llama.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "generation_config.json").read_text()) if (out / "generation_config.json").exists() else {}
    config.update({"temperature": 0.0, "max_new_tokens": 5, "top_k": 7, "do_sample": False})
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def test_reading_the_file(greedy_five, tmp_path):
    assert sampling_defaults("auto", greedy_five) == {"temperature": 0.0, "max_tokens": 5, "top_k": 7}
    assert sampling_defaults("vllm", greedy_five) == {}
    assert sampling_defaults(str(greedy_five), tmp_path) == sampling_defaults("auto", greedy_five)
    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults(str(tmp_path), tmp_path)
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot", "max_new_tokens": -1, "top_p": 0.5}')
    assert sampling_defaults("auto", tmp_path) == {"top_p": 0.5}  # wrong types and "until the end" are skipped


def test_requests_fill_unset_fields_from_the_defaults():
    defaults = {"temperature": 0.2, "top_k": 7, "seed": 3}
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.9)
    params = request.sampling_params(10, None, defaults=defaults)
    assert (params.temperature, params.top_k, params.seed) == (0.9, 7, 3)
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).sampling_params(10, None)
    assert (plain.temperature, plain.top_k, plain.seed) == (1.0, 0, None)


def test_llm_without_sampling_parameters_uses_the_model_defaults(greedy_five):
    llm = LLM(model=str(greedy_five), dtype="float32", kv_cache_memory=0.01)
    [out] = llm.generate(["the quick brown fox"])
    [greedy] = llm.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=5))
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids and len(greedy.outputs[0].token_ids) == 5
    ignored = LLM(model=str(greedy_five), dtype="float32", kv_cache_memory=0.01, generation_config="vllm")
    assert ignored.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
