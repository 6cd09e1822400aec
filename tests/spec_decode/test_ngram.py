"""Speculative decoding with n-gram drafts: greedy output equals decoding without it, token for
token, alone or batched with requests that do not speculate, through chunked prefill, preemption,
prefix-cache hits, stop conditions inside an accepted run and n > 1; blocks are never leaked."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pagoda import LLM, SamplingParams
from pagoda.spec_decode.ngram import propose_ngram

# always speculate, whatever the batch size (the default turns speculation off above 4 running requests)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "disable_by_batch_size": None}
REPETITIVE = ["def main():\n    print('hello world')\n    return 0\n" * 3, "the quick brown fox " * 8,
              "a b c d e f g a b c d", "once upon a time there was a time upon once"]


def test_propose_ngram_takes_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert propose_ngram(tokens, 3, 2, 4) == [4, 5, 9]  # "1 2 3" recurs: what followed it
    assert propose_ngram(np.array([5, 6, 1, 2, 7, 1, 2, 8, 1, 2]), 2, 2, 2) == [8, 1]  # the latest one
    assert propose_ngram(np.array([1, 2, 3]), 3, 2, 4) == []  # nothing recurs
    assert propose_ngram(np.array([7, 8, 7, 8]), 5, 1, 3) == [7, 8]  # only what exists after the match


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """The same small engine with and without speculation; deterministic (batch-invariant), so
    that a different batch composition cannot move a near-tie."""
    args = dict(dtype="float32", kv_cache_memory=0.001, max_num_batched_tokens=48, deterministic=True)
    return LLM(str(tiny_llama), **args), LLM(str(tiny_llama), speculative_config=SPEC, **args)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_output_is_unchanged_and_drafts_are_accepted(engines):
    plain, spec = engines
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = _tokens(plain, REPETITIVE, params)
    before = spec.engine.stats()
    steps = spec.engine.core.num_steps
    assert _tokens(spec, REPETITIVE[:1], params) == want[:1]  # alone
    alone_steps = spec.engine.core.num_steps - steps
    assert alone_steps < 48  # accepted drafts: fewer steps than tokens
    assert _tokens(spec, REPETITIVE, params) == want  # batched
    stats = spec.engine.stats()
    assert stats["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]


def test_penalties_bias_min_tokens_and_logprobs_speculate_and_change_nothing(engines):
    """Each verify row is processed as if the drafts before it had been sampled: penalties over
    the outputs so far, min_tokens, logit bias; logprobs are those of every token of the run.
    Alone and in one batch with plain greedy requests, every request gets what it gets without
    speculation, and drafts are verified for each kind."""
    plain, spec = engines
    kinds = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True, presence_penalty=0.5),
             SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.02, frequency_penalty=0.02,
                            min_tokens=5, logit_bias={7: 0.5})]
    for params in kinds[1:]:
        before = spec.engine.stats()["spec_draft_tokens"]
        assert _tokens(spec, REPETITIVE[:1], params) == _tokens(plain, REPETITIVE[:1], params)
        if params.temperature == 0.0:  # (a sampled answer of this random model rarely repeats: few drafts)
            assert spec.engine.stats()["spec_draft_tokens"] > before, params
    prompts = REPETITIVE * 2
    assert _tokens(spec, prompts, kinds * 2) == _tokens(plain, prompts, kinds * 2)
    logprobs = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
    want = plain.generate(REPETITIVE[:1], logprobs, use_tqdm=False)[0].outputs[0]
    got = spec.generate(REPETITIVE[:1], logprobs, use_tqdm=False)[0].outputs[0]
    assert len(got.logprobs) == len(got.token_ids) == 24
    for w, g in zip(want.logprobs, got.logprobs, strict=True):
        assert list(w) == list(g)  # the same tokens, in the same order
        assert [x.logprob for x in w.values()] == pytest.approx([x.logprob for x in g.values()], abs=1e-4)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


def test_structured_output_drafts_are_checked_against_the_grammar(engines):
    """Drafts the grammar refuses are cut before verification; the rest are verified under the
    mask of their position and the matcher rolls back. The answer is the one without speculation
    and follows the grammar."""
    from pagoda.sampling_params import StructuredOutputsParams

    plain, spec = engines
    prompt = "the quick brown fox " * 6
    for constraint in (StructuredOutputsParams(regex="(the quick brown fox ){3}(jumps|sleeps)"),
                       StructuredOutputsParams(regex="(the (quick|slow) (brown|red) fox ){4}")):
        params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=constraint)
        before = spec.engine.stats()
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        after = spec.engine.stats()
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
        assert got.text.startswith("the quick brown fox the quick brown fox ") or got.text.startswith("the ")


@pytest.mark.parametrize("sampling", [dict(temperature=0.3, top_k=3), dict(temperature=0.3, top_p=0.9, min_p=0.05),
                                      dict(temperature=0.6, top_k=4, presence_penalty=0.1, frequency_penalty=0.05, repetition_penalty=1.05)],
                         ids=["top_k", "top_p_min_p", "penalties"])
def test_sampling_with_drafts_keeps_the_target_distribution(tiny_llama, sampling):
    """Rejection sampling: with drafts accepted and rejected, the tokens at each position follow
    the distribution they follow without speculation (two samples of 1,200 seeded requests,
    total variation under 0.1 per position, where sampling noise is ~0.03). The prompt repeats
    the model's own greedy continuation, so prompt lookup finds drafts the model may choose."""
    args = dict(dtype="float32", kv_cache_memory=0.05, enable_prefix_caching=False)
    plain = LLM(str(tiny_llama), **args)
    base = plain.get_tokenizer().encode(REPETITIVE[1], add_special_tokens=False)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    continuation = plain.generate([{"prompt_token_ids": base}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    prompts = [{"prompt_token_ids": base + continuation * 3}] * 1200
    params = [SamplingParams(max_tokens=4, seed=i, ignore_eos=True, **sampling) for i in range(len(prompts))]
    spec = LLM(str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                                    "disable_by_batch_size": None}, **args)
    want = np.array([o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)])
    got = np.array([o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)])
    stats = spec.engine.stats()
    accepted, drafted = stats["spec_accepted_tokens"], stats["spec_draft_tokens"]
    assert accepted >= 30 and drafted - accepted >= 30, (accepted, drafted)  # both ways taken, often
    for position in range(1, 4):  # the first token comes from the prompt's pass, never a draft
        tokens = np.union1d(want[:, position], got[:, position])
        p = np.array([(want[:, position] == t).mean() for t in tokens])
        q = np.array([(got[:, position] == t).mean() for t in tokens])
        assert 0.5 * np.abs(p - q).sum() < 0.1, (position, dict(zip(tokens.tolist(), zip(p, q))))


def test_stops_inside_an_accepted_run(engines):
    plain, spec = engines
    base = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    free = _tokens(plain, REPETITIVE[:2], base)
    for i, prompt in enumerate(REPETITIVE[:2]):
        tokens = free[i][0]
        stop_id = tokens[17]
        for params in (SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),  # lands inside a run
                       SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])):
            want = _tokens(plain, [prompt], params)
            got = _tokens(spec, [prompt], params)
            assert got == want
        assert len(_tokens(spec, [prompt], SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True))[0][0]) == 13


def test_a_stop_string_inside_an_accepted_run(engines):
    plain, spec = engines
    text = plain.generate(REPETITIVE[:1], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop=[stop])
    want = plain.generate(REPETITIVE[:1], params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(REPETITIVE[:1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)


def test_n_greater_than_one_and_prefix_cache_hits(engines):
    plain, spec = engines
    params = SamplingParams(n=3, max_tokens=20, temperature=0.0, ignore_eos=True)
    want = _tokens(plain, REPETITIVE[:2], params)
    assert _tokens(spec, REPETITIVE[:2], params) == want
    assert _tokens(spec, REPETITIVE[:2], params) == want  # again: the prompts come from the prefix cache


def test_no_block_is_leaked_after_many_random_requests(tiny_llama):
    """Preemption (a tiny cache), chunked prefill, aborts of nothing, drafts accepted and rejected:
    every block comes back."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.00012, max_num_batched_tokens=32,
              speculative_config=SPEC)
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "a", "b", "c", "hello", "world"]
    prompts = [" ".join(rng.choice(words[: rng.randint(2, 9)]) for _ in range(rng.randint(2, 40))) for _ in range(200)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True) for _ in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    core = llm.engine.core
    assert core.scheduler.num_preemptions_total > 0 and core.scheduler.stats().spec_accepted_tokens > 0
    assert core.kv_manager.usage() == 0.0


def test_no_drafts_in_batches_above_disable_by_batch_size(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.01,
              speculative_config={**SPEC, "disable_by_batch_size": 1})
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate(REPETITIVE[:2], params, use_tqdm=False)  # two running: no drafts verified
    assert llm.engine.stats()["spec_draft_tokens"] == 0
    llm.generate(REPETITIVE[:1], params, use_tqdm=False)  # one: drafts
    assert llm.engine.stats()["spec_draft_tokens"] > 0


@pytest.mark.parametrize("config,field", [
    ({"method": "ngram", "num_speculative_tokens": 6}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle"}, "method"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ('{"method": ', "JSON"),
])
def test_bad_speculative_config_names_the_field(tiny_llama, config, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.01, speculative_config=config)


def test_server_with_speculation_reports_acceptance_in_metrics(tiny_llama, capsys, tmp_path):
    import httpx
    from pagoda.bench.servers import scrape_metrics
    from pagoda.cli import main
    from server_process import start_server

    proc, base = start_server(tiny_llama, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        body = {"model": "tiny", "prompt": REPETITIVE[1], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 32
        metrics = scrape_metrics(base)
        drafts, accepted = (metrics["pagoda:spec_decode_num_draft_tokens_total"],
                            metrics["pagoda:spec_decode_num_accepted_tokens_total"])
        assert 0 < accepted <= drafts
        assert metrics["pagoda:spec_decode_num_draft_tokens_per_pos_total"] == drafts  # summed over positions
        assert metrics["pagoda:spec_decode_mean_accepted_length"] > 1
        assert metrics["pagoda:spec_decode_verify_seconds_total"] > 0
        # `pagoda bench serve` reads the same counters and prints what the load did
        dataset = tmp_path / "prompts.jsonl"
        dataset.write_text("\n".join(json.dumps({"prompt": p, "output_len": 24}) for p in REPETITIVE[:2]))
        code = main(["bench", "serve", "--base-url", base, "--model", "tiny", "--tokenizer", str(tiny_llama),
                     "--dataset", str(dataset), "--num-prompts", "2"])
        printed = capsys.readouterr().out
        assert code == 0 and "Speculative Decoding" in printed and "Mean accepted length:" in printed
    finally:
        proc.kill()
        proc.wait(timeout=30)
