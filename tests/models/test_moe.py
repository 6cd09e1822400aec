"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on tiny random models (2 layers,
hidden 64, 4-8 experts, 2 per token): fp32 greedy parity with transformers from the Hugging Face
directory and from GGUF, the routing and the sparse block's output against transformers' own
block on the same hidden states, batched == one at a time, quantized experts in the GGUF fast
path, and tensor parallelism at TP=2."""

from __future__ import annotations

import shutil

import pytest
import torch
from gguf_export import export_gguf
from test_parity import PROMPTS, _check
from tiny_models import MOE_ARCHS, make_tiny_hf_model

from pagoda import LLM, SamplingParams
from pagoda.layers.ggml_blocks import BlockLinear
from pagoda.models.moe import SparseMoeBlock, route

ENGINE = dict(dtype="float32", kv_cache_memory=0.02)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_hf_model(arch, root / arch, seed=20 + i) for i, arch in enumerate(MOE_ARCHS)}


def _hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_parity_and_routing_match_transformers(moe_dirs, arch):
    """Tokens and logprobs of whole generations; then, on the same hidden states, each layer's
    router logits, chosen experts and their weights, and the block's output."""
    llm = LLM(model=str(moe_dirs[arch]), **ENGINE)
    _check(llm, moe_dirs[arch], PROMPTS)
    ref = _hf_model(moe_dirs[arch])
    blocks = llm.engine.core.model.moe_blocks()
    assert len(blocks) == 2 and all(isinstance(b, SparseMoeBlock) for b in blocks)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for block, layer in zip(blocks, ref.model.layers):
            hf_logits, hf_weights, hf_ids = layer.mlp.gate(x)
            logits = block.router_logits(x)
            torch.testing.assert_close(logits, hf_logits, rtol=0, atol=1e-6)
            weights, ids = route(logits, block.top_k, block.renormalize)
            assert torch.equal(ids, hf_ids)
            torch.testing.assert_close(weights, hf_weights.float(), rtol=0, atol=1e-6)
            torch.testing.assert_close(block(x.clone()), layer.mlp(x.unsqueeze(0))[0], rtol=0, atol=1e-5)


def test_routing_normalization_differs_by_family(moe_dirs):
    """Mixtral and Qwen3-MoE renormalize the chosen experts' probabilities, Qwen2-MoE and OLMoE do
    not (norm_topk_prob false), so the weights of their top 2 of 8 sum to less than one."""
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    plain, ids = route(logits, 2, renormalize=False)
    normed, same_ids = route(logits, 2, renormalize=True)
    assert torch.equal(ids, same_ids) and (plain.sum(-1) < 1).all()
    torch.testing.assert_close(normed.sum(-1), torch.ones(5))
    renormalizes = {arch: LLM(model=str(moe_dirs[arch]), **ENGINE).engine.core.model.moe_blocks()[0].renormalize
                    for arch in MOE_ARCHS}
    assert renormalizes == {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}


def test_batched_equals_one_at_a_time(moe_dirs):
    """Every prompt's tokens and logprobs are the same in a batch (experts' matmuls over tokens of
    several sequences, chunked prefill) as alone."""
    llm = LLM(model=str(moe_dirs["qwen2_moe"]), max_num_batched_tokens=24, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, batched in zip(PROMPTS, together):
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == batched.outputs[0].token_ids
        lps = [(next(iter(a.values())).logprob, next(iter(b.values())).logprob)
               for a, b in zip(alone.logprobs, batched.outputs[0].logprobs)]
        assert max(abs(a - b) for a, b in lps) < 1e-5


def test_dense_and_sparse_layers_mixed(tmp_path):
    """Qwen-MoE's mlp_only_layers: layer 1 keeps a dense MLP of intermediate_size (llama.cpp has
    no such file, so the GGUF writer refuses it)."""
    model_dir = make_tiny_hf_model("qwen3_moe", tmp_path / "mixed", seed=5, mlp_only_layers=[1])
    llm = LLM(model=str(model_dir), **ENGINE)
    assert len(llm.engine.core.model.moe_blocks()) == 1
    _check(llm, model_dir, PROMPTS[:3])
    with pytest.raises(ValueError, match="every layer as experts"):
        export_gguf(model_dir, tmp_path / "mixed.gguf")


def _reference_from_gguf(gguf_path, hf_dir, out):
    """transformers given the GGUF's dequantized weights: pagoda's reader yields checkpoint names,
    which transformers' loader stacks into its fused expert tensors as for a hub checkpoint."""
    from safetensors.torch import save_file

    from pagoda.loader.gguf_config import gguf_to_hf_config
    from pagoda.loader.gguf_file import read_gguf
    from pagoda.loader.gguf_weights import iter_gguf_weights

    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / name, out / name)
    weights = iter_gguf_weights(gguf_path, gguf_to_hf_config(read_gguf(gguf_path)))
    save_file({name: w.contiguous() for name, w in weights}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("arch,qtype", [("mixtral", "F32"), ("qwen2_moe", "Q4_0"), ("olmoe", "F16")])
def test_gguf_parity_with_transformers_on_dequantized_weights(moe_dirs, tmp_path, arch, qtype):
    """Written as llama.cpp's converter does (stacked ffn_*_exps, ffn_gate_inp, shared-expert
    tensors; Mixtral as "llama" with experts) and loaded back: transformers' tokens given the same
    weights."""
    gguf_path = export_gguf(moe_dirs[arch], tmp_path / f"{arch}.gguf", qtype=qtype)
    llm = LLM(model=str(gguf_path), **ENGINE)
    hf_config = llm.engine.config.model.hf_config
    assert hf_config["model_type"] == arch and llm.engine.config.model.files.format == "gguf"
    _check(llm, _reference_from_gguf(gguf_path, moe_dirs[arch], tmp_path / "ref"), PROMPTS)


def test_quantized_experts_in_the_gguf_fast_path(moe_dirs, tmp_path):
    """--quantization gguf: every expert's projections (and the shared expert's) stay Q8_0 blocks
    multiplied by the block kernel; scores stay close to the fp32 path on the same file."""
    gguf_path = export_gguf(moe_dirs["qwen2_moe"], tmp_path / "q8.gguf", qtype="Q8_0")
    fp32 = LLM(model=str(gguf_path), **ENGINE)
    fast = LLM(model=str(gguf_path), quantization="gguf", enable_prefix_caching=False, **ENGINE)
    block = fast.engine.core.model.moe_blocks()[0]
    assert all(isinstance(e.gate_up_proj, BlockLinear) and isinstance(e.down_proj, BlockLinear)
               for e in [*block.experts, block.shared_expert])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = fp32.generate(PROMPTS, params, use_tqdm=False)
    scored = fast.generate([{"prompt_token_ids": o.prompt_token_ids + list(o.outputs[0].token_ids)} for o in outs],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    diffs = []
    for o, s in zip(outs, scored):
        got = o.outputs[0]
        fast_lps = [pos[t].logprob for t, pos in zip(got.token_ids, s.prompt_logprobs[-len(got.token_ids):])]
        diffs += [abs(a - next(iter(b.values())).logprob) for a, b in zip(fast_lps, got.logprobs)]
    assert sum(diffs) / len(diffs) < 0.02, sum(diffs) / len(diffs)  # test_gguf_quantized.py's bound for Llama


def test_tp2_gives_tp1_tokens(moe_dirs):
    """Experts and the shared expert sharded like the dense MLP (gate/up rows, down columns), one
    all-reduce per block: TP=1's tokens, logprobs within 1e-5, with chunked prefill and preemption."""
    from executor.test_tensor_parallel import ENGINE as TP_ENGINE
    from executor.test_tensor_parallel import _assert_same, _run

    path = str(moe_dirs["qwen2_moe"])
    want = _run(LLM(path, **TP_ENGINE))
    with LLM(path, tensor_parallel_size=2, **TP_ENGINE) as tp2:
        got = _run(tp2)
    _assert_same(got, want)


def test_bad_expert_settings_are_refused(moe_dirs):
    import json

    from pagoda.models.qwen_moe import Qwen3MoeForCausalLM

    config = json.loads((moe_dirs["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        Qwen3MoeForCausalLM.read_moe_config({**config, "num_experts_per_tok": 9})
    without = {k: v for k, v in config.items() if k not in ("num_experts", "num_local_experts")}
    with pytest.raises(ValueError, match="no num_experts"):
        Qwen3MoeForCausalLM.read_moe_config(without)
