"""--compile changes no output: fp32 greedy tokens and logprobs equal eager's, across batch shapes."""

from __future__ import annotations

from pagoda import LLM, SamplingParams
from pagoda.config import create_engine_config

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France. Berlin is",
           "def main():", "Once upon a time"]


def test_compiled_equals_eager(tiny_llama, tiny_llm, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))  # its own inductor cache
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    compiled = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, compile=True)
    assert compiled.engine.core.runner.forward is not compiled.engine.core.model.forward
    # One at a time, then all together: different batch sizes reuse the dynamic-shape graphs.
    for prompts in ([PROMPTS[0]], PROMPTS):
        got = compiled.generate(prompts, params, use_tqdm=False)
        want = tiny_llm.generate(prompts, params, use_tqdm=False)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for gp, wp in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert abs(gp[next(iter(gp))].logprob - wp[next(iter(wp))].logprob) < 1e-4
    assert (tmp_path / "inductor").is_dir()


def test_enforce_eager_wins(tiny_llama):
    from pagoda.config import EngineArgs

    assert create_engine_config(EngineArgs(model=str(tiny_llama), compile=True, enforce_eager=True)).compile is False
