"""Shared by the state-space families' tests (test_mamba2.py, test_bamba.py): their tiny models,
and pagoda's greedy tokens against transformers' on them, alone, batched, chunked and preempted.

transformers' reference generates with ``min_new_tokens`` (the tiny models' eos ban), so pagoda
runs with ``min_tokens`` of the same length: both ban eos for every token (``ignore_eos`` would
let pagoda pick it where transformers may not)."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from window_checks import MAX_TOKENS, assert_matches, prompt, reference

# lengths around transformers' scan chunks of 8: one token (a decode row from the start), a
# part of one chunk, several, and a prompt that a 7-token budget splits into six steps
PROMPT_LENGTHS = (1, 5, 17, 40)
PROMPTS = [prompt(n, seed=n) for n in PROMPT_LENGTHS]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def transformers_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def check_alone_and_batched(model_dir, expected, **engine_args) -> LLM:
    """Each prompt on its own, then all of them in flight together, give transformers' tokens."""
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, **engine_args)
    for p, e in zip(PROMPTS, expected):
        assert_matches(run(llm, [p]), [e])
    assert_matches(run(llm, PROMPTS), expected)
    return llm


def check_abort_frees_every_slot(llm: LLM) -> None:
    """Aborted requests give their state slots back, as finished ones do."""
    engine = llm.engine
    states = engine.core.scheduler.states
    assert states.num_free == states.num_slots
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert states.num_free == states.num_slots - len(PROMPTS)
    for i in range(len(PROMPTS)):
        engine.abort_request(f"abort-{i}")
    assert states.num_free == states.num_slots
    assert not engine.has_unfinished_requests()


def check_prefix_hits(model_dir, **engine_args) -> None:
    """Requests after a cached prefix start from the state kept at its last snapshot boundary
    (here every 8-token block, or every other one) and still give transformers' tokens: a shared
    system prompt with another suffix, and the same prompt again."""
    system = prompt(30, seed=100)
    first, other = system + prompt(7, seed=101), system + prompt(11, seed=102)
    expected = reference(transformers_model(model_dir), [first, other, first])
    for interval, hits in ((8, [0, 24, 32]), (16, [0, 16, 32])):
        llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, block_size=8,
                  state_snapshot_interval=interval, **engine_args)
        outs = [run(llm, [p])[0] for p in (first, other, first)]
        assert [o.num_cached_tokens for o in outs] == hits
        assert_matches(outs, expected)
        assert llm.engine.core.kv_manager.snapshots.num_hits == 2


@pytest.fixture(scope="module")
def expected_tokens(model_dir):
    return reference(transformers_model(model_dir), PROMPTS)
