"""Mamba-2 (``Mamba2ForCausalLM``): pagoda's fp32 greedy tokens equal transformers' on a tiny
random-weight model, alone, batched (decodes beside prompts), chunked, and a request's state slot
comes back when it is aborted."""

from __future__ import annotations

import pytest

from pagoda import LLM
from state_space_checks import (PROMPTS, check_abort_frees_every_slot, check_alone_and_batched, check_prefix_hits,
                                expected_tokens, run)  # noqa: F401 - expected_tokens is a fixture
from tiny_models import make_tiny_hf_model
from window_checks import assert_matches


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model("mamba2", tmp_path_factory.mktemp("mamba2"))


def test_mamba2_matches_transformers_alone_and_batched(model_dir, expected_tokens):
    llm = check_alone_and_batched(model_dir, expected_tokens)
    core = llm.engine.core
    assert core.scheduler.states.num_free == core.scheduler.states.num_slots  # every finished request's slot is back
    check_abort_frees_every_slot(llm)


def test_mamba2_chunked_prefill_matches_transformers(model_dir, expected_tokens):
    """A 7-token budget: the 40-token prompt runs in six chunks, each from the state the last one
    left, beside the other requests' decodes."""
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=7, block_size=8)
    assert_matches(run(llm, PROMPTS), expected_tokens)


@pytest.mark.parametrize("budget", [2048, 7])
def test_mamba2_prefix_hits_start_from_the_kept_state(model_dir, budget):
    """Whole prompts, and prompts in 7-token chunks (snapshots inside a chunk and at its end)."""
    check_prefix_hits(model_dir, max_num_batched_tokens=budget)
