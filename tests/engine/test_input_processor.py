"""The input path (pagoda/engine/input_processor.py): the prompt forms it takes, n > 1 fanned out
into seeded children, and the core's limits checked before anything is queued."""

from __future__ import annotations

import pytest

from pagoda.engine.core import RequestLimits
from pagoda.engine.input_processor import InputProcessor, fan_out
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def processor(tiny_llama) -> InputProcessor:
    inputs = InputProcessor(Tokenizer(tiny_llama))
    inputs.limits = RequestLimits(max_model_len=32, vocab_size=inputs.tokenizer.vocab_size, num_blocks=8)
    return inputs


def test_text_and_token_prompts(processor):
    text, ids = processor.tokenize_prompt("the cat")
    assert text == "the cat" and ids == processor.tokenizer.encode("the cat")
    assert processor.tokenize_prompt({"prompt_token_ids": [3, 4]}) == (None, [3, 4])
    for bad in ({"prompt_token_ids": [1, True]}, {"nothing": 1}, 7):
        with pytest.raises(ValueError):
            processor.tokenize_prompt(bad)


def test_n_fans_out_into_seeded_children():
    children = fan_out("r", SamplingParams(n=3, seed=10))
    assert [cid for cid, _ in children] == ["0_r", "1_r", "2_r"]
    assert [p.seed for _, p in children] == [10, 11, 12] and all(p.n == 1 for _, p in children)
    assert fan_out("r", SamplingParams())[0][0] == "r"


def test_a_prepared_request_carries_its_end_tokens_and_salt(processor):
    prepared = processor.prepare_request("r", {"prompt_token_ids": [3, 4], "cache_salt": "t1"},
                                         SamplingParams(n=2, max_tokens=4))
    assert [r.request_id for r in prepared.core_requests] == ["0_r", "1_r"]
    assert all(r.cache_salt == "t1" for r in prepared.core_requests)
    assert all(r.sampling_params.all_stop_token_ids == processor.eos_token_ids for r in prepared.core_requests)


def test_the_limits_refuse_before_anything_is_queued(processor):
    with pytest.raises(ValueError, match="max_model_len|context|32"):
        processor.prepare_request("r", {"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError):
        processor.prepare_request("r", {"prompt_token_ids": [10**6]}, SamplingParams(max_tokens=4))
