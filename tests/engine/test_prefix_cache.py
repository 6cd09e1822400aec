"""Prefix caching in the engine: exact outputs, cached-token counts, multi-turn reuse, salts."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def cached_llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)


@pytest.fixture(scope="module")
def uncached_llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False)


def _prompts(seed: int, prefix_len: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 380) for _ in range(prefix_len)]
    return [{"prompt_token_ids": prefix + [rng.randrange(3, 380) for _ in range(rng.randint(1, 9))]} for _ in range(n)]


def test_outputs_with_cache_hits_equal_outputs_without_cache(cached_llm, uncached_llm):
    prompts = _prompts(0, 70, 6)
    reference = [o.outputs[0].token_ids for o in uncached_llm.generate(prompts, GREEDY, use_tqdm=False)]
    first = cached_llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache with the prefix
    second = cached_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == reference
    assert first[0].outputs[0].token_ids == reference[0]
    assert all(o.num_cached_tokens >= 64 for o in second)  # 70 shared tokens → 4 whole blocks at least
    assert all(o.num_cached_tokens == 0 for o in uncached_llm.generate(prompts, GREEDY, use_tqdm=False))


def test_shared_prefix_batch_reports_expected_cached_tokens(cached_llm):
    prompts = _prompts(1, 64, 5)  # a 64-token prefix = exactly 4 blocks
    cached_llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    outs = cached_llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [64] * 4
    stats = cached_llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] >= 4 * 64 and 0 < stats["prefix_cache_hit_rate"] <= 1
    assert 0.0 <= stats["memory_pressure"] <= 1.0


def test_multi_turn_computes_only_the_new_tokens(cached_llm):
    rng = random.Random(2)
    history = [rng.randrange(3, 380) for _ in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for turn in range(5):
        out = cached_llm.generate([{"prompt_token_ids": history}], params, use_tqdm=False)[0]
        if turn:
            computed_before = prev_prompt + prev_output - 1  # the last sampled token had no KV yet
            assert out.num_cached_tokens == computed_before // BS * BS
            assert len(history) - out.num_cached_tokens <= (len(history) - computed_before) + BS - 1
        prev_prompt, prev_output = len(history), len(out.outputs[0].token_ids)
        history = history + out.outputs[0].token_ids + [rng.randrange(3, 380) for _ in range(7)]  # next user turn


def test_cache_salt_keeps_tenants_apart(cached_llm):
    prompt = _prompts(3, 48, 1)
    engine = cached_llm.engine
    for salt, expect_hit in [("alice", False), ("alice", True), ("bob", False), (None, False)]:
        engine.add_request(f"salt-{salt}-{expect_hit}", prompt[0], GREEDY, cache_salt=salt)
        result = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    result = out
        assert (result.num_cached_tokens > 0) == expect_hit, salt


def test_eviction_under_pressure_keeps_outputs_exact(tiny_llama, uncached_llm):
    # 14 blocks: cached prefixes must be evicted to admit new work; nothing may break.
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    small = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=14 * per_block / 2**30)
    prompts = _prompts(4, 40, 4) + _prompts(5, 40, 4)
    reference = [o.outputs[0].token_ids for o in uncached_llm.generate(prompts, GREEDY, use_tqdm=False)]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY, use_tqdm=False)] == reference
    kv = small.engine.core.kv_manager
    assert kv.num_free_blocks == 14 and kv.usage() == 0.0


def test_cache_salt_in_the_prompt_dict(cached_llm):
    prompt = _prompts(6, 48, 1)[0]
    salted = dict(prompt, cache_salt="tenant-x")
    first = cached_llm.generate([salted], GREEDY, use_tqdm=False)[0]
    again = cached_llm.generate([salted], GREEDY, use_tqdm=False)[0]
    other = cached_llm.generate([dict(prompt, cache_salt="tenant-y")], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48 and other.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == other.outputs[0].token_ids


def test_prompt_logprobs_are_complete_on_a_cached_prompt(cached_llm, uncached_llm):
    prompt = _prompts(5, 46, 1)
    with_lps = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    cached_llm.generate(prompt, GREEDY, use_tqdm=False)  # the prompt's blocks are now cached
    again = cached_llm.generate(prompt, with_lps, use_tqdm=False)[0]
    reference = uncached_llm.generate(prompt, with_lps, use_tqdm=False)[0]
    n = len(prompt[0]["prompt_token_ids"])
    assert len(again.prompt_logprobs) == len(reference.prompt_logprobs) == n
    assert again.num_cached_tokens == 0  # it computed the prompt to get them
    for got, want in zip(again.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
