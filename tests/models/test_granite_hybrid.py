"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``: Mamba-2 mixers, attention without rotary, a
shared MLP beside 4 experts, multipliers on the embeddings, the residual branches and the
logits): pagoda's fp32 greedy tokens equal transformers' on a tiny random-weight model, alone,
batched, chunked and after prefix hits, and on its dense form (no experts: Granite 4.0-H-Micro's)."""

from __future__ import annotations

import pytest

from pagoda import LLM
from state_space_checks import (PROMPTS, check_alone_and_batched, check_prefix_hits, expected_tokens,  # noqa: F401
                                run, transformers_model)
from tiny_models import make_tiny_hf_model
from window_checks import assert_matches, reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model("granitemoehybrid", tmp_path_factory.mktemp("granite"))


def test_granite_hybrid_matches_transformers_alone_batched_and_chunked(model_dir, expected_tokens):
    model = check_alone_and_batched(model_dir, expected_tokens).engine.core.model
    assert len(model.attention_layers()) == 1 and len(model.state_layers()) == 3
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=7, block_size=8)
    assert_matches(run(llm, PROMPTS), expected_tokens)


def test_granite_hybrid_prefix_hits_start_from_the_kept_state(model_dir):
    check_prefix_hits(model_dir, max_num_batched_tokens=7)


def test_dense_granite_hybrid_matches_transformers(tmp_path):
    dense = make_tiny_hf_model("granitemoehybrid", tmp_path / "dense", seed=1, num_local_experts=0)
    check_alone_and_batched(dense, reference(transformers_model(dense), PROMPTS))
