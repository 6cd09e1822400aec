"""Bamba (``BambaForCausalLM``, Mamba-2 mixers and Llama attention with a half rotary): pagoda's
fp32 greedy tokens equal transformers' on a tiny random-weight model, alone, batched, chunked and
under preemption (the state slots and KV blocks of a preempted request are freed, and it is
recomputed into another slot), and an aborted request's slot comes back."""

from __future__ import annotations

import pytest

from pagoda import LLM
from state_space_checks import (PROMPTS, check_abort_frees_every_slot, check_alone_and_batched, check_prefix_hits,
                                expected_tokens, run, transformers_model)  # noqa: F401 - expected_tokens is a fixture
from tiny_models import make_tiny_hf_model
from window_checks import assert_matches, prompt, reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model("bamba", tmp_path_factory.mktemp("bamba"))


def test_bamba_matches_transformers_alone_and_batched(model_dir, expected_tokens):
    llm = check_alone_and_batched(model_dir, expected_tokens)
    model = llm.engine.core.model
    assert len(model.attention_layers()) == 1 and len(model.state_layers()) == 3
    check_abort_frees_every_slot(llm)


def test_bamba_chunked_prefill_matches_transformers(model_dir, expected_tokens):
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=7, block_size=8)
    assert_matches(run(llm, PROMPTS), expected_tokens)


def test_bamba_preemption_frees_state_and_recomputes(model_dir):
    """Two state slots and 30 blocks of 8 tokens (the states take half the budget): two
    120-token prompts fill the cache, so running requests are preempted (their slots and blocks
    freed) and recomputed later from zero states, with transformers' tokens still."""
    per_slot = 3 * 4 * ((128 + 2 * 2 * 16) * 3 + 8 * 16 * 16)  # 3 mixers, fp32: conv window + scan state
    llm = LLM(model=str(model_dir), dtype="float32", block_size=8, max_num_seqs=2, kv_cache_memory=4 * per_slot / 2**30,
              enable_prefix_caching=False)  # (with it, a snapshot slot beside each running one halves the slots)
    core = llm.engine.core
    states = core.scheduler.states
    assert states.num_slots == 2 and core.num_blocks == 2 * per_slot // (2 * 8 * 2 * 16 * 4)
    prompts = [prompt(120, seed=s) for s in range(3)]
    assert_matches(run(llm, prompts), reference(transformers_model(model_dir), prompts))
    assert core.scheduler.num_preemptions_total > 0
    assert states.num_free == states.num_slots and core.kv_manager.num_free_blocks == core.num_blocks


@pytest.mark.parametrize("budget", [2048, 7])
def test_bamba_prefix_hits_start_from_the_kept_state(model_dir, budget):
    """Whole prompts, and prompts in 7-token chunks (snapshots inside a chunk and at its end)."""
    check_prefix_hits(model_dir, max_num_batched_tokens=budget)
