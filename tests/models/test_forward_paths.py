"""One forward per model: every family gives the same tokens with the fused decode stack allowed
and with it turned off (--no-fused-decode), and the engine reports which path it chose and why."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.layers.cpu_kernels import load_cpu_kernels
from tiny_models import MOE_ARCHS, make_tiny_hf_model

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")

# The families whose layers the fused op chains; the others report why not.
FUSED = {"llama", "mistral", "phi3"}
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", *MOE_ARCHS]
PROMPTS = ["The quick brown fox", "Paris is the capital of", "Once upon a time there"]


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_both_forwards_give_the_same_tokens(family, tmp_path):
    model = make_tiny_hf_model(family, tmp_path / family, seed=40)
    args = {"model": str(model), "dtype": "float32", "kv_cache_memory": 0.02}
    allowed = LLM(**args)
    path = allowed.engine.core.forward_path
    assert path["fused_decode"] == (family in FUSED), path
    assert path["reason"]  # on: what it covers; off: why not
    turned_off = LLM(**args, fused_decode=False)
    assert not turned_off.engine.core.forward_path["fused_decode"]
    assert _tokens(allowed) == _tokens(turned_off)
