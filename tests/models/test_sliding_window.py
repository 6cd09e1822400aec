"""Mistral-style sliding windows (every layer attends to its last ``sliding_window`` positions) on
the Llama layers: which layers a config windows, and greedy parity with transformers around the
window's edges through every attention path, the one-call decoder stack included."""

from __future__ import annotations

import pytest
import torch
from test_decode_stack import count_stack_calls
from tiny_models import TINY_WINDOW
from window_checks import assert_matches, prompt, reference, run, track_peak_blocks

from pagoda import LLM
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.models.config import layer_windows

W = TINY_WINDOW
EDGE_PROMPTS = [prompt(5, 1), prompt(W, 2), prompt(W + 1, 3), prompt(3 * W + 5, 4)]


def test_which_layers_a_config_windows():
    assert layer_windows({"model_type": "mistral", "sliding_window": 4096}, 3) == (4096,) * 3
    assert layer_windows({"model_type": "mistral", "sliding_window": None}, 2) == (None, None)
    assert layer_windows({"model_type": "llama"}, 2) == (None, None)
    # Qwen's configs carry a window that is off unless use_sliding_window says so
    assert layer_windows({"model_type": "qwen2", "sliding_window": 4096, "max_window_layers": 1}, 2) == (None, None)
    assert layer_windows({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                          "max_window_layers": 1}, 3) == (None, 64, 64)
    types = ["full_attention", "sliding_attention"]
    assert layer_windows({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
                          "layer_types": types}, 2) == (None, 64)
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows({"sliding_window": 64, "layer_types": ["chunked_attention"]}, 1)


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_dirs):
    return tiny_model_dirs["mistral"]


@pytest.fixture(scope="module")
def expected(mistral_dir):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    assert ref.config.sliding_window == W
    return reference(ref, EDGE_PROMPTS)


@pytest.mark.parametrize("args", [
    {},
    {"block_size": 8, "max_num_batched_tokens": 5},
    {"block_size": 8, "deterministic": True},
], ids=["default", "chunked", "deterministic"])
def test_window_edges_equal_transformers(mistral_dir, expected, args):
    llm = LLM(model=str(mistral_dir), dtype="float32", kv_cache_memory=0.02, **args)
    assert llm.engine.core.model.config.sliding_windows == (W, W)
    assert_matches(run(llm, EDGE_PROMPTS), expected)


def test_window_edges_on_the_torch_fallback(mistral_dir, expected, torch_kernels_only):
    llm = LLM(model=str(mistral_dir), dtype="float32", kv_cache_memory=0.02, block_size=8, max_num_batched_tokens=7)
    assert_matches(run(llm, EDGE_PROMPTS), expected)


@pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")
def test_decoder_stack_applies_the_window(mistral_dir, expected, monkeypatch):
    """The one-call stack runs the decodes (each layer's window passed to the paged kernel) and
    gives the Python layers' results bit for bit."""
    calls = count_stack_calls(monkeypatch)
    args = {"dtype": "float32", "kv_cache_memory": 0.02, "enable_prefix_caching": False}
    stacked = run(LLM(model=str(mistral_dir), **args), EDGE_PROMPTS)
    assert calls[0] > 0
    assert_matches(stacked, expected)
    python = run(LLM(model=str(mistral_dir), fused_decode=False, **args), EDGE_PROMPTS)
    for a, b in zip(stacked, python):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [p[t].logprob for t, p in zip(a.outputs[0].token_ids, a.outputs[0].logprobs)] == \
               [p[t].logprob for t, p in zip(b.outputs[0].token_ids, b.outputs[0].logprobs)]


def test_prefix_hits_across_the_window(mistral_dir):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    llm = LLM(model=str(mistral_dir), dtype="float32", kv_cache_memory=0.02, block_size=8)
    base = prompt(50, 7)
    run(llm, [base])
    prompts = [base[:40] + prompt(3, 8), base[:48] + prompt(40, 9), base]
    outs = run(llm, prompts)
    assert [o.num_cached_tokens for o in outs] == [40, 48, 48]
    assert_matches(outs, reference(ref, prompts))


def test_out_of_window_blocks_are_released_without_prefix_caching(mistral_dir, expected, monkeypatch):
    """Every layer windowed and no prefix cache: a running request gives back the blocks wholly
    before its window, so two requests of 150 tokens run together in a 24-block cache (192
    tokens) and their outputs do not change; another request reuses the released blocks."""
    peak = track_peak_blocks(monkeypatch)
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, 8 tokens, 2 kv heads of 16, fp32
    args = {"dtype": "float32", "block_size": 8, "kv_cache_memory": 24 * per_block / 2**30}
    prompts, n = [prompt(30, 21), prompt(31, 22)], 120
    llm = LLM(model=str(mistral_dir), enable_prefix_caching=False, **args)
    kv = llm.engine.core.kv_manager
    assert kv.pool.num_blocks == 24 and kv.sliding_window == W
    outs = run(llm, prompts, n)
    assert kv.num_released_blocks > 2 * 10 and kv.pool.num_free_blocks == 24
    assert peak[0] <= 2 * (-(-(W + 8) // 8) + 1)  # each request holds about its window's blocks
    assert_matches(run(llm, EDGE_PROMPTS), expected)  # on blocks the others released

    peak[0] = 0
    kept = LLM(model=str(mistral_dir), enable_prefix_caching=True, **args)  # the tree keeps whole prefixes
    assert kept.engine.core.kv_manager.sliding_window is None
    alone = [run(kept, [p], n)[0] for p in prompts]  # one at a time: 19 blocks each
    assert peak[0] >= 19 and kept.engine.core.kv_manager.num_released_blocks == 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
