"""The fused decode stack (pagoda/models/decode_stack.py) computes exactly what the Python layers
compute, for float and block-quantized weights; where it cannot run a model, the engine reports why."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.layers.ggml_blocks import BlockLinear
from pagoda.layers.packed_weights import block_packing, packing_applies
from pagoda.models.decode_stack import DecodeStack

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time there"]


def _run(llm: LLM, prompts: list[str] = PROMPTS, max_tokens: int = 10):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def count_stack_calls(monkeypatch) -> list[int]:
    """The rows of every call the stack takes from now on, in order."""
    calls: list[int] = []
    original = DecodeStack.__call__

    def counted(self, hidden, *args):
        calls.append(hidden.shape[0])
        return original(self, hidden, *args)

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    return calls


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_stack_equals_the_python_layers_bit_for_bit(tiny_llama, quantization, monkeypatch):
    args = {"dtype": "float32", "kv_cache_memory": 0.02, "quantization": quantization}
    calls = count_stack_calls(monkeypatch)
    fast = _run(LLM(model=str(tiny_llama), **args))
    assert len(calls) >= 9  # every decode step of the batch went through the stack
    calls.clear()
    python = _run(LLM(model=str(tiny_llama), fused_decode=False, **args))
    assert not calls
    assert fast == python  # tokens and logprobs identical, not merely close


def test_stack_takes_packed_block_weights_from_their_many_row_threshold(tiny_llama, monkeypatch):
    """A decode batch at or above block_matmul's library threshold runs through the stack on the
    blocks' packed copies (where this build packs them), with the Python layers' bits."""
    rows, _ = load_cpu_kernels().block_matmul_gemm()
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(rows + 2)]
    args = {"dtype": "float32", "kv_cache_memory": 0.02, "quantization": "int4"}
    widths = count_stack_calls(monkeypatch)
    llm = LLM(model=str(tiny_llama), **args)
    if packing_applies(load_cpu_kernels()) and block_packing(load_cpu_kernels()) != "none":
        model = llm.engine.core.model
        assert all(m.packed is not None for m in model.modules() if isinstance(m, BlockLinear))
    fast = _run(llm, prompts, max_tokens=6)
    assert max(widths) >= rows  # the whole batch's decode steps went through the stack
    assert fast == _run(LLM(model=str(tiny_llama), fused_decode=False, **args), prompts, max_tokens=6)


def test_stack_is_chosen_once_and_says_why_not(tiny_model_dirs, monkeypatch):
    calls = count_stack_calls(monkeypatch)
    cases = {"qk_norm": LLM(model=str(tiny_model_dirs["qwen3"]), dtype="float32", kv_cache_memory=0.02),
             "bias": LLM(model=str(tiny_model_dirs["qwen2"]), dtype="float32", kv_cache_memory=0.02),
             "narrower dtype": LLM(model=str(tiny_model_dirs["llama"]), dtype="bfloat16", kv_cache_memory=0.02),
             "--no-fused-decode": LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory=0.02,
                                      fused_decode=False)}
    for why, llm in cases.items():
        path = llm.engine.core.forward_path
        assert not path["fused_decode"] and why in path["reason"], path
        assert llm.engine.core.model.decode_stack is None
        assert len(_run(llm)) == len(PROMPTS)
    assert not calls
    llama = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory=0.02)
    assert llama.engine.core.forward_path["fused_decode"]
    stack = llama.engine.core.model.decode_stack
    assert stack is not None and len(stack.k_caches) == len(llama.engine.core.model.layers)
    from pagoda.forward_context import AttentionMetadata, PrefillSeq

    with_prefill = AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.long), num_decodes=1,
                                     prefills=[PrefillSeq(1, 3, 0, torch.zeros(1, dtype=torch.long))])
    assert not stack.applies(with_prefill)
    assert stack.applies(AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.long), num_decodes=4))


@pytest.mark.parametrize("quantization", [None, "int4"])  # float32 adapters; bfloat16 ones over a quantized base
def test_stack_adds_lora_deltas_as_the_python_layers_do(tiny_llama, tmp_path, quantization, monkeypatch):
    """Rows under two adapters (one on every projection, down included; one on q and v) and rows
    on the base, in one batch: the stack's tokens and logprobs equal the Python layers' bit for bit."""
    from pagoda.lora import LoRARequest
    from tests.lora.adapters import make_peft_adapter

    adapters = [LoRARequest("all", 1, str(make_peft_adapter(tiny_llama, tmp_path / "all", seed=1))),
                LoRARequest("qv", 2, str(make_peft_adapter(tiny_llama, tmp_path / "qv", seed=2, rank=4,
                                                           targets=["q_proj", "v_proj"])))]
    loras = [lora for lora in (None, *adapters) for _ in PROMPTS]
    prompts = PROMPTS * 3
    with_adapters: list[int] = []
    original = DecodeStack.__call__

    def counted(self, hidden, residual, positions, meta):
        if meta.lora is not None:
            with_adapters.append(hidden.shape[0])
        return original(self, hidden, residual, positions, meta)

    monkeypatch.setattr(DecodeStack, "__call__", counted)
    args = {"dtype": "float32", "kv_cache_memory": 0.02, "quantization": quantization, "enable_lora": True,
            "max_loras": 2}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)

    def run(llm: LLM):
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in p.items()} for p in o.outputs[0].logprobs])
                for o in outs]

    fast = run(LLM(model=str(tiny_llama), **args))
    assert with_adapters.count(len(prompts)) >= 9  # the mixed batch's decode steps
    with_adapters.clear()
    python = run(LLM(model=str(tiny_llama), fused_decode=False, **args))
    assert not with_adapters
    assert fast == python
    assert fast[0][0] != fast[len(PROMPTS)][0]  # the adapter changes the answer
