"""pagoda's greedy fp32 tokens under a LoRA adapter equal transformers + peft's on the same
adapter: for every family, alone and in a batch mixing adapters and the base, chunked, and after a
prefix-cache hit (which must never cross adapters)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.lora import LoRARequest
from tests.lora.adapters import make_peft_adapter, peft_greedy
from tests.tiny_models import make_tiny_hf_model

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog. Paris is the capital of",
           "Once upon a time there was a little engine that could"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# the modules each family's PEFT adapters name (Phi-3 keeps q/k/v and gate/up fused; a mixture's
# experts are not adapted, its attention is)
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _mixed_run(llm: LLM, model_dir, adapters: list, tmp_path) -> None:
    """Every prompt under the base and each adapter, all in one batch, against the reference."""
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    loras = [None, *(LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters))]
    requests = [(lora, p) for lora in loras for p in PROMPTS]
    outs = llm.generate([p for _, p in requests], GREEDY, use_tqdm=False, lora_request=[lora for lora, _ in requests])
    got = [o.outputs[0].token_ids for o in outs]
    want = [t for path in [None, *adapters] for t in peft_greedy(model_dir, path, ids, MAX_TOKENS)]
    assert got == want
    assert got[:len(PROMPTS)] != got[len(PROMPTS):2 * len(PROMPTS)]  # the adapter changes the answer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_mixed_batch_parity(tiny_model_dirs, tmp_path, arch):
    model_dir = tiny_model_dirs[arch]
    adapters = [make_peft_adapter(model_dir, tmp_path / "all", seed=1),
                make_peft_adapter(model_dir, tmp_path / "qv", seed=2, rank=4, targets=["q_proj", "v_proj"],
                                  use_rslora=True)]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, enable_lora=True, max_loras=2)
    _mixed_run(llm, model_dir, adapters, tmp_path)


@pytest.mark.parametrize("arch", ["phi3", "mixtral"])
def test_fused_and_mixture_families(tmp_path, arch):
    model_dir = make_tiny_hf_model(arch, tmp_path / arch)
    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", seed=3, targets=TARGETS[arch])
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, enable_lora=True)
    _mixed_run(llm, model_dir, [adapter], tmp_path)


def test_chunked_prefill_one_adapter_at_a_time_and_prefix_hits(tiny_llama, tmp_path):
    """max_loras=1 runs three adapters' requests one adapter at a time, a 5-token budget chunks
    every prompt, and a repeated prompt hits the cache under its own adapter only."""
    adapters = [make_peft_adapter(tiny_llama, tmp_path / f"a{i}", seed=10 + i) for i in range(3)]
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, enable_lora=True, max_loras=1,
              max_cpu_loras=1, max_num_batched_tokens=16, long_prefill_token_threshold=5, max_num_partial_prefills=2)
    _mixed_run(llm, tiny_llama, adapters, tmp_path)
    long_prompt = "A prompt no request above began with, long enough to fill a few blocks of the cache. " * 2
    lora = LoRARequest("a0", 1, str(adapters[0]))
    first, again = (llm.generate([long_prompt], GREEDY, use_tqdm=False, lora_request=lora)[0] for _ in range(2))
    other = llm.generate([long_prompt], GREEDY, use_tqdm=False, lora_request=LoRARequest("a1", 2, str(adapters[1])))[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0  # the same prompt under another adapter: no shared KV
    base = llm.generate([long_prompt], GREEDY, use_tqdm=False)[0]
    assert base.num_cached_tokens == 0
    assert base.outputs[0].token_ids == peft_greedy(tiny_llama, None, [base.prompt_token_ids], MAX_TOKENS)[0]


def test_tensor_parallel_cuts_adapters_like_the_weights(tiny_llama, tmp_path):
    """Two ranks: B cut by rows for q/k/v and gate/up, A by columns for o and down, the row-parallel
    deltas summed by the layers' all-reduce; the tokens are transformers + peft's."""
    adapter = make_peft_adapter(tiny_llama, tmp_path / "tp", seed=5)
    with LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.01, tensor_parallel_size=2, enable_lora=True) as llm:
        _mixed_run(llm, tiny_llama, [adapter], tmp_path)


def test_quantized_base_batches_adapters_as_it_runs_them_alone(tiny_llama, tmp_path):
    """An int8 base with its adapters in bfloat16 (auto): a mixed batch gives each request what it gets alone."""
    adapters = [make_peft_adapter(tiny_llama, tmp_path / f"q{i}", seed=30 + i) for i in range(2)]
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, enable_lora=True, max_loras=2,
              quantization="int8", enable_prefix_caching=False)
    loras = [None, LoRARequest("q0", 1, str(adapters[0])), LoRARequest("q1", 2, str(adapters[1]))]
    requests = [(lora, p) for lora in loras for p in PROMPTS]
    mixed = llm.generate([p for _, p in requests], GREEDY, use_tqdm=False, lora_request=[lo for lo, _ in requests])
    alone = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=lo)[0] for lo, p in requests]
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    assert mixed[0].outputs[0].token_ids != mixed[len(PROMPTS)].outputs[0].token_ids


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_experts_adapters(tmp_path, arch):
    """PEFT's LoRA on transformers' fused expert weights (target_parameters), beside the attention's:
    each expert's rows take their own adapter's delta."""
    model_dir = make_tiny_hf_model(arch, tmp_path / arch)
    adapters = [make_peft_adapter(model_dir, tmp_path / f"e{i}", seed=40 + i, rank=4, targets=["q_proj", "o_proj"],
                                  parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]) for i in range(2)]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, enable_lora=True, max_loras=2)
    _mixed_run(llm, model_dir, adapters, tmp_path)


@pytest.mark.parametrize("arch", ["phi3", "mixtral"])
def test_tensor_parallel_cuts_fused_and_expert_pairs(tmp_path, arch):
    """Phi-3's fused q/k/v and gate/up pairs and a mixture's experts' pairs, cut part by part on two ranks."""
    model_dir = make_tiny_hf_model(arch, tmp_path / arch)
    parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if arch == "mixtral" else None
    adapter = make_peft_adapter(model_dir, tmp_path / "tp", seed=6, targets=TARGETS[arch], parameters=parameters)
    with LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, tensor_parallel_size=2, enable_lora=True) as llm:
        _mixed_run(llm, model_dir, [adapter], tmp_path)
