"""The engine end to end on a tiny model: batching, preemption, aborts, sampling options."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import RequestOutputKind

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is",
    "def main():",
    "Once upon a time there was a little engine that could",
    "In 1492, Columbus sailed",
    "pagoda serves language models",
    "你好，世界",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_one_at_a_time(tiny_llm):
    batched = _tokens(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    alone = [_tokens(tiny_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert batched == alone
    assert all(len(t) == 24 for t in batched)


def test_preemption_under_tiny_kv_budget_gives_identical_output(tiny_llama, tiny_llm):
    reference = _tokens(tiny_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False))
    # 12 blocks of 16 tokens: 8 requests of ~50 tokens each cannot all stay resident.
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head dim, fp32
    small = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=12 * per_block / 2**30)
    assert small.engine.core.num_blocks == 12
    outs = small.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert _tokens(outs) == reference
    assert small.engine.core.scheduler.num_preemptions_total > 0
    assert small.engine.core.kv_manager.num_free_blocks == 12


def test_abort_frees_every_block(tiny_llm):
    engine = tiny_llm.engine
    total = engine.core.num_blocks
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core.kv_manager.num_free_blocks < total
    for i in range(len(PROMPTS)):
        engine.abort_request(f"abort-{i}")
    assert engine.core.kv_manager.num_free_blocks == total
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_seeded_sampling_is_reproducible_batched_or_not(tiny_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate([PROMPTS[2]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed_params = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)] * 3 + [seeded]
    batched = tiny_llm.generate(PROMPTS[:3] + [PROMPTS[2]], mixed_params, use_tqdm=False)[3].outputs[0].token_ids
    assert alone == batched
    other = tiny_llm.generate([PROMPTS[2]], seeded.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_n_samples_with_seed(tiny_llm):
    out = tiny_llm.generate([PROMPTS[1]], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = tiny_llm.generate([PROMPTS[1]], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_top_k_one_is_greedy(tiny_llm):
    greedy = _tokens(tiny_llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False))
    topk1 = _tokens(tiny_llm.generate(PROMPTS[:3], SamplingParams(temperature=1.5, top_k=1, max_tokens=24, ignore_eos=True), use_tqdm=False))
    assert topk1 == greedy


def test_stop_string_is_excluded_from_text(tiny_llm):
    full = tiny_llm.generate([PROMPTS[4]], GREEDY, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    out = tiny_llm.generate([PROMPTS[4]], GREEDY.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = tiny_llm.generate([PROMPTS[4]], GREEDY.clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.engine.core.kv_manager.num_free_blocks == tiny_llm.engine.core.num_blocks


def test_stop_token_ids_and_min_tokens(tiny_llm):
    full = tiny_llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[2]
    first = full.index(stop_id)
    out = tiny_llm.generate([PROMPTS[0]], GREEDY.clone(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens bans the stop token until that many tokens exist
    out = tiny_llm.generate([PROMPTS[0]], GREEDY.clone(stop_token_ids=[stop_id], min_tokens=first + 3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 3
    assert stop_id not in out.token_ids[: first + 2]


def test_max_tokens_finishes_with_length(tiny_llm):
    out = tiny_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length" and out.finished


def test_logprobs_count_and_ranks(tiny_llm):
    out = tiny_llm.generate([PROMPTS[1]], GREEDY.clone(logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, position in zip(out.token_ids, out.logprobs):
        assert token in position and position[token].rank == 1  # greedy picks the top token
        assert len(position) == 3  # the chosen token is also the top-1
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


def test_penalties_reduce_repetition(tiny_llm):
    base = _tokens(tiny_llm.generate(PROMPTS, GREEDY.clone(max_tokens=32), use_tqdm=False))
    penalized = _tokens(tiny_llm.generate(PROMPTS, GREEDY.clone(max_tokens=32, frequency_penalty=2.0, presence_penalty=2.0), use_tqdm=False))
    repetition = _tokens(tiny_llm.generate(PROMPTS, GREEDY.clone(max_tokens=32, repetition_penalty=3.0), use_tqdm=False))
    distinct = lambda runs: sum(len(set(t)) for t in runs)  # noqa: E731
    assert distinct(penalized) > distinct(base)
    assert distinct(repetition) > distinct(base)


def test_logit_bias_forces_a_token(tiny_llm):
    out = tiny_llm.generate([PROMPTS[0]], GREEDY.clone(max_tokens=6, logit_bias={42: 100.0}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [42] * 6


def test_delta_outputs_concatenate_to_final_text(tiny_llm):
    engine = tiny_llm.engine
    params = GREEDY.clone(max_tokens=30, output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta", PROMPTS[7], params)
    pieces, tokens, finishes = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            pieces.append(c.text)
            tokens += c.token_ids
            finishes += c.finish_reason is not None
    final = tiny_llm.generate([PROMPTS[7]], GREEDY.clone(max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert "".join(pieces) == final.text and tokens == final.token_ids and finishes == 1


def test_token_id_prompts(tiny_llm):
    ids = tiny_llm.get_tokenizer().encode(PROMPTS[1])
    a = tiny_llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    b = tiny_llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == ids


def test_chat_applies_template(tiny_llm):
    conv = [{"role": "user", "content": "Hello"}]
    out = tiny_llm.chat(conv, GREEDY.clone(max_tokens=4), use_tqdm=False)[0]
    tok = tiny_llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_priority_runs_first_when_slots_are_scarce(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, max_num_seqs=1)
    engine = llm.engine
    engine.add_request("low", PROMPTS[0], GREEDY.clone(max_tokens=3))
    engine.add_request("high", PROMPTS[1], GREEDY.clone(max_tokens=3), priority=10)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_a_steady_decode_batch_reuses_its_sampling_metadata(tiny_llama):
    """Decode steps over the same requests get the last step's sampling metadata again (issue
    13: Python per step); a request joining or leaving, or parameters that change as tokens come
    (a repetition penalty), build it afresh, and the tokens are those of a fresh build."""
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)
    engine, runner = llm.engine, llm.engine.core.runner
    seen = []
    sample = runner.sampler

    def recording(logits, md):
        seen.append((md, md.temperature.tolist()))
        return sample(logits, md)

    runner.sampler = recording
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    hot = SamplingParams(temperature=0.7, top_k=1, max_tokens=12, ignore_eos=True)  # top_k 1: still greedy
    engine.add_request("a", {"prompt": PROMPTS[0]}, short)
    engine.add_request("b", {"prompt": PROMPTS[1]}, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        if "a" in outs and "c" not in engine.output_processor.requests and "c" not in outs:
            engine.add_request("c", {"prompt": PROMPTS[2]}, hot)  # joins as "a" leaves
    reused = [later is earlier for (earlier, _), (later, _) in zip(seen, seen[1:])]
    assert any(reused)  # steady steps shared one object
    assert any(abs(x - 0.7) < 1e-6 for _, t in seen for x in t)  # c's own temperature, in a fresh build
    alone = _tokens(llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False))
    assert outs["c"].outputs[0].token_ids == alone[0]
    penalized = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    seen.clear()
    llm.generate(PROMPTS[:2], penalized, use_tqdm=False)
    assert not any(later is earlier for (earlier, _), (later, _) in zip(seen, seen[1:]))
