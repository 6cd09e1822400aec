"""Rope scaling and Phi-3 on tiny random models, fp32 greedy parity with transformers: Llama 3.x's
``llama3`` scaling, Qwen2.5's ``yarn``, and Phi-3 (fused qkv / gate_up checkpoint, LongRoPE with a
64-token original context), from the Hugging Face directory and from GGUF."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_export import export_gguf
from test_parity import PROMPTS, _check
from tiny_models import PHI3_ORIGINAL_CONTEXT, make_tiny_hf_model
from window_checks import prompt

from pagoda import LLM, SamplingParams
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.models.config import rope_scaling

ENGINE = dict(dtype="float32", kv_cache_memory=0.02)
SHORT_PROMPTS = PROMPTS[:4]  # within the tiny Phi-3's original context with their 16 new tokens


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return make_tiny_hf_model("phi3", tmp_path_factory.mktemp("phi3") / "m", seed=31)


@pytest.mark.parametrize("arch,scaling", [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}),
])
def test_llama3_and_yarn_scaling_match_transformers(tmp_path, arch, scaling):
    model_dir = make_tiny_hf_model(arch, tmp_path / arch, seed=41, rope_parameters=scaling)
    llm = LLM(model=str(model_dir), **ENGINE)
    rotary = llm.engine.core.model.layers[0].self_attn.rotary
    plain = RotaryEmbedding(rotary.head_dim, rotary.max_position, rotary.base)
    assert not torch.allclose(rotary.cos_cache, plain.cos_cache)  # the scaling is in the tables
    _check(llm, model_dir, PROMPTS)


def test_phi3_matches_transformers_from_hf_and_gguf(phi3_dir, tmp_path):
    """The fused qkv_proj / gate_up_proj split into Llama's merged projections; the GGUF (attn_qkv,
    ffn_up holding gate and up, the LongRoPE factors as rope_factors_* tensors) reads back the same
    model: F32 equals transformers, Q8_0 in the fast path keeps its blocks."""
    _check(LLM(model=str(phi3_dir), **ENGINE), phi3_dir, SHORT_PROMPTS)
    gguf_path = export_gguf(phi3_dir, tmp_path / "phi3.gguf")
    llm = LLM(model=str(gguf_path), **ENGINE)
    hf_config = llm.engine.config.model.hf_config
    assert rope_scaling(hf_config)["long_factor"] == pytest.approx(
        json.loads((phi3_dir / "config.json").read_text())["rope_parameters"]["long_factor"])
    _check(llm, phi3_dir, SHORT_PROMPTS)


def test_phi3_decoding_past_the_original_context(phi3_dir):
    """A 50-token prompt decoded to 80: positions from 64 on rotate with the long factors, the
    cached ones keep theirs, as transformers' model computes a cached decode step there. (Its
    generate() instead drops the cache once and recomputes the whole sequence with the long
    factors; pagoda does not, see layers/rotary.py.)"""
    import transformers

    ids, new = prompt(50, 5), 30
    out = LLM(model=str(phi3_dir), **ENGINE).generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0),
        use_tqdm=False)[0].outputs[0]
    ref = transformers.AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32).eval()
    tokens, want, cache, step = [], [], None, torch.tensor([ids])
    with torch.no_grad():
        for position in range(len(ids), len(ids) + new):  # greedy, one cached step at a time
            logits = ref(step, past_key_values=cache, use_cache=True,
                         position_ids=torch.arange(position - step.shape[1], position).unsqueeze(0))
            cache, logprobs = logits.past_key_values, torch.log_softmax(logits.logits[0, -1], -1)
            tokens.append(int(logprobs.argmax()))
            want.append(logprobs[tokens[-1]].item())
            step = torch.tensor([[tokens[-1]]])
    assert len(ids) + new > PHI3_ORIGINAL_CONTEXT and out.token_ids == tokens
    assert max(abs(pos[t].logprob - w) for pos, t, w in zip(out.logprobs, tokens, want)) < 1e-4


def test_unsupported_rope_settings_are_refused():
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        rope_scaling({"rope_parameters": {"rope_type": "longrope", "partial_rotary_factor": 0.75}})
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        RotaryEmbedding(16, 32, 1e4, rope_scaling({"rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    phi3_su = rope_scaling({"model_type": "phi3", "max_position_embeddings": 128, "original_max_position_embeddings": 32,
                            "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}})
    assert phi3_su["rope_type"] == "longrope" and phi3_su["original_max_position_embeddings"] == 32
