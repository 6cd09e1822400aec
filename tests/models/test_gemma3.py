"""Gemma 3 on a tiny random model (4 layers: local, local, global, local; a window of 12 tokens):
greedy tokens and logprobs equal transformers' around the window's edges, through every attention
path (the paged kernel, chunked and cached prefill, the pure-torch fallback, deterministic
inference), with prefix-cache hits across the window, and from a GGUF in the fast path.
The real Gemma 3 270M: tests/e2e/test_gemma3_270m.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import TINY_WINDOW, make_tiny_hf_model
from window_checks import assert_matches, prompt, reference, run, track_peak_blocks

from pagoda import LLM, SamplingParams
from pagoda.models.config import layer_windows
from pagoda.models.gemma3 import Gemma3ForCausalLM, rope_settings

W = TINY_WINDOW
# shorter than, equal to, one past, and several blocks past the window
EDGE_PROMPTS = [prompt(5, 1), prompt(W, 2), prompt(W + 1, 3), prompt(3 * W + 5, 4)]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """query_pre_attn_scalar 24 with head_dim 32: the query scale is not head_dim's."""
    return make_tiny_hf_model("gemma3", tmp_path_factory.mktemp("gemma3") / "m", seed=11, query_pre_attn_scalar=24)


@pytest.fixture(scope="module")
def ref(gemma_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(ref):
    return reference(ref, EDGE_PROMPTS)


def test_config_reads_both_forms(gemma_dir):
    """transformers 5's rope_parameters per layer type, or the older keys (hub configs)."""
    new = json.loads((gemma_dir / "config.json").read_text())
    cfg = Gemma3ForCausalLM.read_config(new)
    assert cfg.sliding_windows == (W, W, None, W) and cfg.qk_norm and cfg.hidden_act == "gelu_pytorch_tanh"
    assert rope_settings(new) == ((1e6, None), (1e4, None))
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert rope_settings(old) == ((1e6, {"rope_type": "linear", "factor": 8.0}), (1e4, None))
    assert Gemma3ForCausalLM.read_config(old).sliding_windows == (W, W, None, W)
    assert layer_windows({**old, "sliding_window_pattern": None}, 6) == (W,) * 6  # no pattern: Mistral's rule
    del old["sliding_window_pattern"]
    assert Gemma3ForCausalLM.read_config({**old, "num_hidden_layers": 7}).sliding_windows == (W,) * 5 + (None, W)
    with pytest.raises(ValueError, match="soft-capping"):
        Gemma3ForCausalLM.read_config({**new, "attn_logit_softcapping": 50.0})


@pytest.mark.parametrize("args", [
    {},  # whole prompts: SDPA (banded past the window); decodes: the paged kernel
    {"block_size": 8, "max_num_batched_tokens": 5},  # chunks over cached blocks; windows across blocks
    {"block_size": 8, "deterministic": True},  # every token a row of the paged kernel
], ids=["default", "chunked", "deterministic"])
def test_window_edges_equal_transformers(gemma_dir, expected, args):
    llm = LLM(model=str(gemma_dir), dtype="float32", kv_cache_memory=0.02, **args)
    assert_matches(run(llm, EDGE_PROMPTS), expected)


def test_window_edges_on_the_torch_fallback(gemma_dir, expected, torch_kernels_only):
    llm = LLM(model=str(gemma_dir), dtype="float32", kv_cache_memory=0.02, block_size=8, max_num_batched_tokens=7)
    assert llm.engine.core.model.backend.name == "torch"
    assert_matches(run(llm, EDGE_PROMPTS), expected)


def test_the_window_matters(gemma_dir, tmp_path):
    """The same model with a window longer than the prompt scores a long prompt the same up to
    the window and differently after it (so the tests above do test the window)."""
    full = tmp_path / "unbounded"
    shutil.copytree(gemma_dir, full)
    config = json.loads((full / "config.json").read_text())
    config["sliding_window"] = 4096  # the local layers keep their rotary base
    (full / "config.json").write_text(json.dumps(config))
    scored = []
    for model_dir in (gemma_dir, full):
        llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02)
        out = llm.generate([{"prompt_token_ids": EDGE_PROMPTS[3]}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        scored.append(torch.tensor([next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]]))
    diff = (scored[0] - scored[1]).abs()  # diff[i]: the token at position i + 1, seen from position i
    assert diff[:W].max() < 1e-5 and diff[W:].min() > 1e-4


def test_prefix_hits_across_the_window(gemma_dir, ref):
    """Cached prefixes whose blocks lie partly or wholly outside the window of the tokens after
    them: a short tail (decode rows over the cached blocks), a long one (a chunk that gathers only
    the blocks from its first window on), a whole cached prompt, and a hit shorter than the window."""
    llm = LLM(model=str(gemma_dir), dtype="float32", kv_cache_memory=0.02, block_size=8)
    base = prompt(50, 7)
    run(llm, [base])  # caches 6 full blocks: 48 tokens, 4 windows' worth
    prompts = [base[:40] + prompt(3, 8), base[:48] + prompt(40, 9), base, base[:17] + prompt(2, 10)]
    outs = run(llm, prompts)
    assert [o.num_cached_tokens for o in outs] == [40, 48, 48, 16]
    assert_matches(outs, reference(ref, prompts))


LONG_PROMPTS, LONG_OUTPUT = [prompt(30, 21), prompt(31, 22)], 120


@pytest.fixture(scope="module")
def long_expected(ref):
    return reference(ref, LONG_PROMPTS, LONG_OUTPUT)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_local_layers_hold_only_their_window(gemma_dir, ref, long_expected, prefix_caching, monkeypatch):
    """The local layers' block tables (3 groups beside the global layer's) give back the blocks
    their window has passed: two 150-token requests run together in a 64-block cache (each would
    take 4 x 19 = 76 blocks with one table for every layer), without a preemption, and still give
    transformers' tokens. With the prefix cache, the tree keeps those blocks until the room is needed."""
    peak = track_peak_blocks(monkeypatch)
    llm = LLM(model=str(gemma_dir), dtype="float32", block_size=8, enable_prefix_caching=prefix_caching,
              max_num_batched_tokens=32, kv_cache_memory=64 * _bytes_per_block(gemma_dir, 8) / 2**30)
    core = llm.engine.core
    assert core.num_blocks == 64 and core.kv_manager.num_groups == 4 and core.kv_manager.local_window == W
    prompts = LONG_PROMPTS
    outs = run(llm, prompts, LONG_OUTPUT)
    assert core.scheduler.num_preemptions_total == 0 and core.kv_manager.num_released_blocks > 2 * 3 * 10
    if not prefix_caching:  # each request: 19 global blocks and about its window's in each local group
        assert peak[0] <= 2 * (19 + 3 * (-(-(W + 8) // 8) + 1))
    assert_matches(outs, long_expected)
    if prefix_caching:
        # The early blocks' local parts went first under pressure (least recently let go); the end
        # of the first request's sequence is cached whole, its last window included.
        whole = prompts[0] + outs[0].outputs[0].token_ids[:-1]
        again = run(llm, [prompts[0], whole])
        assert again[0].num_cached_tokens == 0 and again[1].num_cached_tokens == 144
        assert_matches(again, reference(ref, [prompts[0], whole]))


def _bytes_per_block(model_dir, block_size: int) -> int:
    """One pool block of the tiny Gemma 3: K and V of one slot (one layer per group), fp32."""
    config = json.loads((model_dir / "config.json").read_text())
    return 2 * block_size * config["num_key_value_heads"] * config["head_dim"] * 4


def test_chat_on_the_tiny_model(gemma_dir, ref):
    llm = LLM(model=str(gemma_dir), dtype="float32", kv_cache_memory=0.02)
    conversation = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 2}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=MAX_CHAT, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > W
    assert out.outputs[0].token_ids == reference(ref, [out.prompt_token_ids], MAX_CHAT)[0][0]


MAX_CHAT = 8


@pytest.fixture(scope="module")
def gemma_gguf(tiny_model_dirs, tmp_path_factory):
    from gguf_export import export_gguf

    return export_gguf(tiny_model_dirs["gemma3"], tmp_path_factory.mktemp("g3") / "gemma3-Q8_0.gguf", qtype="Q8_0")


def test_gguf_fast_path_stays_close_to_fp32(gemma_gguf):
    """--quantization gguf: Q8_0 projections and the tied head as blocks (int8 activations, as
    llama.cpp), the Python layers (no one-call stack for Gemma): close to the fp32 path."""
    from pagoda.layers.ggml_blocks import BlockLinear

    prompts = EDGE_PROMPTS
    fp32 = run(LLM(model=str(gemma_gguf), dtype="float32", kv_cache_memory=0.02), prompts)
    fast = LLM(model=str(gemma_gguf), dtype="float32", kv_cache_memory=0.02, quantization="gguf",
               enable_prefix_caching=False)
    model = fast.engine.core.model
    assert sum(isinstance(m, BlockLinear) for m in model.modules()) == 4 * 4 + 1 and model.decode_stack is None
    # fp32's continuations scored by the fast path
    ids = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, fp32)]
    scored = fast.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)
    diffs = []
    for s, o in zip(scored, fp32):
        got = o.outputs[0]
        fast_lps = [pos[t].logprob for t, pos in zip(got.token_ids, s.prompt_logprobs[-len(got.token_ids):])]
        fp32_lps = [pos[t].logprob for t, pos in zip(got.token_ids, got.logprobs)]
        diffs += [abs(a - b) for a, b in zip(fast_lps, fp32_lps)]
    assert sum(diffs) / len(diffs) < 0.02, sum(diffs) / len(diffs)  # as test_gguf_quantized.py bounds Llama's


def test_gguf_writer_refuses_what_llama_cpp_would_run_differently(gemma_dir, tmp_path):
    from gguf_export import export_gguf

    with pytest.raises(ValueError, match="query_pre_attn_scalar 24"):
        export_gguf(gemma_dir, tmp_path / "g.gguf")


def test_model_classes_and_gguf_share_one_table():
    from pagoda.loader import gguf_config, gguf_writer
    from pagoda.models import architectures, model_classes

    assert set(gguf_config.SUPPORTED_ARCHITECTURES) == set(model_classes.GGUF_HF_CLASSES) == {
        "llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen2moe", "qwen3moe", "olmoe"}
    assert architectures.GGUF_EXPERT_ARCHITECTURES == {"llama": ("MixtralForCausalLM", "mixtral")}
    assert set(model_classes.GGUF_HF_CLASSES.values()) <= set(model_classes.MODEL_CLASSES)
    assert model_classes.MODEL_CLASSES["Gemma3ForCausalLM"] is Gemma3ForCausalLM
    assert gguf_writer._ARCHITECTURES is architectures.GGUF_WRITE_ARCHITECTURES
