"""Which of a step's tokens run as rows of the paged decode kernel (worker/batch_layout.py), and
that the choice does not change an answer: with the C++ kernels a short fresh prompt runs so too
(the rest take the flash-style prefill kernel), where the torch backend (which would gather every
row's blocks) keeps one causal SDPA call."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda import LLM, SamplingParams
from pagoda.worker.batch_layout import decode_like_rows

# requests: one decode, one token after a prefix, short chunks fresh and over a prefix, long chunks
COUNTS = np.array([1, 1, 40, 40, 600, 600])
STARTS = np.array([0, 70, 0, 70, 0, 70])


def test_single_tokens_and_short_chunks_over_a_prefix_are_decode_rows():
    assert decode_like_rows(COUNTS, STARTS, 512).tolist() == [True, True, False, True, False, False]


def test_with_fresh_short_prompts_too_only_long_chunks_are_left():
    assert decode_like_rows(COUNTS, STARTS, 512, fresh=True).tolist() == [True, True, True, True, False, False]
    assert decode_like_rows(COUNTS, STARTS, 40, fresh=True).tolist() == [True, True, True, True, False, False]
    assert decode_like_rows(COUNTS, STARTS, 39, fresh=True).tolist() == [True, True, False, False, False, False]


def runner(llm: LLM):
    return llm.engine.core.executor.driver_worker.runner


def fresh_prompt_is_decode_like(llm: LLM) -> bool:
    return bool(runner(llm)._decode_like(np.array([128]), np.array([0]))[0])


# prompts of 5 to 200 tokens: within a block, across several, and a burst of them in one step
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * n) % 250 + 3 for i in range(n)]} for n in (5, 17, 33, 100, 200)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def generate(model, **kwargs) -> tuple[LLM, list]:
    llm = LLM(model=str(model), dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False, **kwargs)
    return llm, [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_short_fresh_prompts_through_the_paged_kernel_answer_as_through_the_flash_kernel(tiny_llama):
    paged, paged_outs = generate(tiny_llama, short_chunk_tokens=512)
    flash, flash_outs = generate(tiny_llama, short_chunk_tokens=1)  # only single tokens run as decode rows
    assert fresh_prompt_is_decode_like(paged) and not fresh_prompt_is_decode_like(flash)
    for a, b in zip(paged_outs, flash_outs, strict=True):
        assert a.token_ids == b.token_ids
        for x, y, token in zip(a.logprobs, b.logprobs, a.token_ids):
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


def test_the_torch_backend_keeps_sdpa_for_fresh_prompts(tiny_llama, torch_kernels_only):
    llm, _ = generate(tiny_llama, short_chunk_tokens=512)
    assert not runner(llm).backend.has_cpu_kernels
    assert not fresh_prompt_is_decode_like(llm)
