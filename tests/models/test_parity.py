"""pagoda's fp32 greedy tokens and logprobs equal transformers' on the same weights, for every
family (Mistral and Gemma 3 with a sliding window of 12, shorter than most prompts here)."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.layers.cpu_kernels import load_cpu_kernels

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. Paris is the capital of",
    "def main():\n    print('hello world')",
    "你好，世界 😀",
    "Once upon a time there was a little engine that could, and it batched every request it saw, "
    "numbers like 3.14159 and 2718 too.",
]
MAX_TOKENS = 16


def _reference(model_dir, prompt_ids: list[list[int]]):
    """transformers greedy continuation and the logprob of each generated token."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = ref.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                               do_sample=False, pad_token_id=0)
            full = out[0]
            logprobs = torch.log_softmax(ref(full.unsqueeze(0)).logits[0].float(), dim=-1)
            new = full[len(ids):]
            lps = logprobs[len(ids) - 1 : -1].gather(1, new.unsqueeze(1)).squeeze(1)
            results.append((new.tolist(), lps.tolist()))
    return results


def _check(llm: LLM, model_dir, prompts):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)  # all prompts in flight together
    ref = _reference(model_dir, [o.prompt_token_ids for o in outs])
    for prompt, out, (ref_tokens, ref_lps) in zip(prompts, outs, ref):
        assert out.prompt_token_ids == tok.encode(prompt)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"token mismatch for {prompt!r}"
        ours = [next(iter(pos.values())).logprob for pos in got.logprobs]
        assert list(got.logprobs[0].keys())[0] == ref_tokens[0]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_greedy_parity_with_transformers(tiny_model_dirs, arch):
    model_dir = tiny_model_dirs[arch]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02)
    _check(llm, model_dir, PROMPTS)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma3"])
def test_parity_with_chunked_prefill_and_small_blocks(tiny_model_dirs, arch):
    """Prompts split over several steps (token budget 7) and 8-token blocks give the same tokens
    (with a sliding window of 12: chunks and decodes whose window starts inside a block)."""
    model_dir = tiny_model_dirs[arch]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=7, block_size=8)
    _check(llm, model_dir, PROMPTS)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_parity_with_every_prefill_chunk_on_the_flash_kernel(tiny_model_dirs, arch, monkeypatch):
    """``short_chunk_tokens=1``: every chunk of more than one token, fresh or over a cached prefix
    (token budget 7, 8-token blocks; Mistral's and Gemma 3's windows of 12), runs the C++ flash-style
    prefill kernel instead of the decode-rows path, and the tokens stay transformers'."""
    from pagoda.layers.backend import CpuKernelBackend

    if load_cpu_kernels() is None:
        pytest.skip("pagoda's C++ kernels cannot be built here")
    calls = []
    kernel = CpuKernelBackend.prefill_attention
    monkeypatch.setattr(CpuKernelBackend, "prefill_attention",
                        lambda self, q, *args, **kw: calls.append(q.shape[0]) or kernel(self, q, *args, **kw))
    model_dir = tiny_model_dirs[arch]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=7, block_size=8,
              short_chunk_tokens=1)
    _check(llm, model_dir, PROMPTS)
    assert calls and max(calls) > 1


def test_tied_embeddings_parity(tmp_path):
    from tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("llama", tmp_path / "tied", seed=7, tie_word_embeddings=True)
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02)
    _check(llm, model_dir, PROMPTS[:3])


def test_prompt_logprobs_match_transformers(tiny_model_dirs):
    import transformers

    model_dir = tiny_model_dirs["llama"]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=5)
    out = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0], dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        position = out.prompt_logprobs[i]
        assert abs(position[ids[i]].logprob - lp[i - 1, ids[i]].item()) < 1e-4
        top2 = lp[i - 1].topk(2).indices.tolist()
        assert set(top2) <= set(position)
        assert position[ids[i]].rank == int((lp[i - 1] > lp[i - 1, ids[i]]).sum()) + 1


@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("qwen2", "Q8_0"), ("qwen3", "Q4_1"), ("llama", "Q4_0"),
                                        ("gemma3", "F32"), ("gemma3", "Q4_0")])
def test_gguf_parity_with_transformers_on_dequantized_weights(tiny_model_dirs, tmp_path, arch, qtype):
    """A tiny model written to GGUF (llama.cpp names, permuted Q/K, quantized) and loaded back
    runs exactly like transformers given the same dequantized weights."""
    import transformers
    from gguf_export import export_gguf

    from pagoda.loader.gguf_weights import iter_gguf_weights

    gguf_path = export_gguf(tiny_model_dirs[arch], tmp_path / f"{arch}-{qtype}.gguf", qtype=qtype)
    llm = LLM(model=str(gguf_path), dtype="float32", kv_cache_memory=0.02)
    files = llm.engine.config.model.files
    assert files.format == "gguf"
    ref_dir = tmp_path / "ref"
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(dict(iter_gguf_weights(gguf_path, files.hf_config())), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if ref.config.tie_word_embeddings else set())
    ref.tie_weights()
    ref.save_pretrained(ref_dir)
    (ref_dir / "tokenizer.json").write_bytes((tiny_model_dirs[arch] / "tokenizer.json").read_bytes())
    _check(llm, ref_dir, PROMPTS)
