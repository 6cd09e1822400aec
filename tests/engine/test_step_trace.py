"""The engine's recorder (pagoda/engine/step_trace.py) on a real tiny engine: chunked prefill,
preemption and finishes as the per-request timelines and step records tell them."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.step_trace import _BINS, _bin, percentiles

PROMPTS = [f"Prompt number {i} talks about the weather in Paris and in Rome, at length." for i in range(8)]


@pytest.fixture(scope="module")
def small(tiny_llama):
    """12 KV blocks and 16-token steps: long prompts are chunked and 8 requests preempt each other."""
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head dim, fp32 (tests/engine/test_llm.py)
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=12 * per_block / 2**30,
               max_num_batched_tokens=16)


def test_timelines_show_chunks_preemptions_and_finishes(small):
    outs = small.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    core = small.engine.core
    traces = {r["request_id"]: r for r in core.debug_snapshot("requests")["requests"]}
    assert len(traces) == len(PROMPTS) and all(t["state"] == "finished" for t in traces.values())
    for out in outs:
        trace = traces[out.request_id]
        assert trace["prompt_tokens"] == len(out.prompt_token_ids) and trace["output_tokens"] == 40
        assert trace["finish_reason"] == "length"
        chunks = trace["prefill_chunks"]
        assert all(c["tokens"] <= 16 for c in chunks) and [c["step"] for c in chunks] == sorted(c["step"] for c in chunks)
        first = sum(c["tokens"] for c in chunks if c["start_ms"] < trace["first_token_ms"])
        if not trace["preemptions_ms"]:  # the prompt, chunk by chunk, then a token
            assert first == trace["prompt_tokens"] - trace["cached_tokens"]
        assert trace["queued_ms"] <= chunks[0]["start_ms"] < trace["first_token_ms"] <= trace["total_ms"]
    preempted = [t for t in traces.values() if t["preemptions_ms"]]
    assert preempted and sum(len(t["preemptions_ms"]) for t in traces.values()) == core.scheduler.num_preemptions_total
    for trace in preempted:  # recomputed after a preemption: more prefill chunks than the prompt needs
        assert sum(c["tokens"] for c in trace["prefill_chunks"]) > trace["prompt_tokens"] - trace["cached_tokens"]

    steps = core.debug_snapshot("steps")["steps"]
    assert len(steps) == min(256, core.num_steps) and steps[0]["step"] == core.num_steps - 1
    assert sum(s["preempted"] for s in steps) <= core.scheduler.num_preemptions_total
    assert all(s["prefill_tokens"] + s["decode_tokens"] <= 16 for s in steps)
    engine = core.debug_snapshot("engine")
    generated = sum(p["generated_tokens"] for p in engine["series"])
    assert generated <= 8 * 40 and engine["stats"]["num_preemptions_total"] == core.scheduler.num_preemptions_total


def test_percentiles_of_a_histogram():
    histogram = [0] * _BINS
    for seconds in [0.001] * 50 + [0.010] * 40 + [1.0] * 10:
        histogram[_bin(seconds)] += 1
    p = percentiles(histogram)
    assert 0.88 < p["p50"] < 1.13 and 8.8 < p["p90"] < 11.3 and 880 < p["p99"] < 1130  # ms, bins 1.25x wide
    assert percentiles([0] * _BINS) == {"p50": None, "p90": None, "p99": None}
