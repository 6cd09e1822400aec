"""The decoder stack in one C++ call (pagoda/models/decode_stack.py) computes exactly what the
Python layers compute, for float and block-quantized weights, and steps aside where it does not apply."""

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
    monkeypatch.setattr(DecodeStack, "build", classmethod(lambda cls, model, ops: None))
    calls.clear()
    python = _run(LLM(model=str(tiny_llama), **args))
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
    monkeypatch.setattr(DecodeStack, "build", classmethod(lambda cls, model, ops: None))
    assert fast == _run(LLM(model=str(tiny_llama), **args), prompts, max_tokens=6)


def test_stack_steps_aside_where_it_does_not_apply(tiny_model_dirs, monkeypatch):
    calls = count_stack_calls(monkeypatch)
    qwen3 = LLM(model=str(tiny_model_dirs["qwen3"]), dtype="float32", kv_cache_memory=0.02)  # q/k norms
    qwen2 = LLM(model=str(tiny_model_dirs["qwen2"]), dtype="float32", kv_cache_memory=0.02)  # qkv biases
    bf16 = LLM(model=str(tiny_model_dirs["llama"]), dtype="bfloat16", kv_cache_memory=0.02)
    for llm in (qwen3, qwen2, bf16):
        model = llm.engine.core.model
        assert DecodeStack.build(model, model.backend.decode_stack_ops()) is None
        assert len(_run(llm)) == len(PROMPTS)
    assert not calls
    llama = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory=0.02)
    model = llama.engine.core.model
    stack = DecodeStack.build(model, model.backend.decode_stack_ops())
    assert stack is not None and len(stack.k_caches) == len(llama.engine.core.model.layers)
    hidden = torch.zeros(4, 8)
    from pagoda.forward_context import AttentionMetadata, PrefillSeq

    with_prefill = AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.long), num_decodes=1,
                                     prefills=[PrefillSeq(1, 3, 0, torch.zeros(1, dtype=torch.long))])
    assert not stack.applies(hidden, with_prefill)
    assert stack.applies(hidden, AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.long), num_decodes=4))
