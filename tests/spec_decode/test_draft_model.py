"""Speculative decoding with a draft model: greedy output equals decoding without it, whatever the
draft proposes (an int8 copy of the target that mostly agrees, an unrelated model that mostly
does not), alone or batched, through preemption, chunked prefill and prefix-cache hits (which the
draft reuses too); blocks are never leaked; bad drafts are refused with the field named."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from tiny_models import make_tiny_hf_model

PROMPTS = ["the quick brown fox jumps", "hello world", "a b c d e f g", "once upon a time there was",
           "def main():\n    return 0\n"]
ARGS = dict(dtype="float32", kv_cache_memory=0.002, max_num_batched_tokens=48, deterministic=True)


def _draft(target, **extra) -> dict:
    """Always draft (no turn-down by batch size or by acceptance): these tests check what drafts do."""
    return {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4,
            "disable_by_batch_size": None, "adaptive": False, **extra}


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """A tiny Llama with the same tokenizer and other weights: its drafts are mostly rejected."""
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("draft") / "llama", seed=7)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(str(tiny_llama), **ARGS)


@pytest.fixture(scope="module")
def int8_drafted(tiny_llama):
    return LLM(str(tiny_llama), speculative_config=_draft(tiny_llama, quantization="int8"), **ARGS)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_output_is_unchanged_alone_and_batched(plain, int8_drafted):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = _tokens(plain, PROMPTS, params)
    steps = int8_drafted.engine.core.num_steps
    assert _tokens(int8_drafted, PROMPTS[:1], params) == want[:1]
    assert int8_drafted.engine.core.num_steps - steps < 20  # most drafts accepted: far fewer steps than tokens
    assert _tokens(int8_drafted, PROMPTS, params) == want
    stats = int8_drafted.engine.stats()
    assert 0.5 < stats["spec_acceptance_rate"] < 1.0  # a quantized draft agrees often, not always
    per_pos = stats["spec_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and per_pos == sorted(per_pos, reverse=True)  # a later draft needs the earlier ones
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + stats["spec_accepted_tokens"] / stats["spec_num_drafts"])
    assert stats["spec_draft_seconds"] > 0 and stats["spec_verify_seconds"] > 0


def test_penalties_bias_min_tokens_logprobs_and_grammar_under_drafts(plain, int8_drafted):
    """The draft proposes without the request's penalties, bias or grammar; verification applies
    them at each position as if the drafts before it had been sampled (strong penalties make the
    target disagree with the draft often), so each answer, logprobs included, is the one without
    speculation, alone and batched."""
    from pagoda.sampling_params import StructuredOutputsParams

    kinds = [SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5,
                            ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.0, min_tokens=10, logit_bias={5: 2.0, 9: -2.0}),
             SamplingParams(max_tokens=30, temperature=0.0, logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.0,  # refuses some drafts, allows most
                            structured_outputs=StructuredOutputsParams(regex="[^aeo]*"))]
    for params in kinds:
        before = int8_drafted.engine.stats()
        want = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        got = int8_drafted.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        after = int8_drafted.engine.stats()
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), params
        assert after["spec_draft_tokens"] > before["spec_draft_tokens"], params
        if params.logprobs is not None:
            assert [list(p) for p in got.logprobs] == [list(p) for p in want.logprobs]
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    prompts = PROMPTS * 2
    batch = (kinds * 2)[: len(prompts)]
    assert _tokens(int8_drafted, prompts, batch) == _tokens(plain, prompts, batch)


def test_requests_that_opt_out_share_the_batch(plain, int8_drafted):
    """SamplingParams(speculative=False): that request never drafts, in a batch with requests that do."""
    out_params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=False)
    before = int8_drafted.engine.stats()["spec_num_drafts"]
    assert _tokens(int8_drafted, PROMPTS[:2], out_params) == _tokens(plain, PROMPTS[:2], out_params)
    assert int8_drafted.engine.stats()["spec_num_drafts"] == before
    mixed = [out_params, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 2
    assert _tokens(int8_drafted, PROMPTS[:4], mixed) == _tokens(plain, PROMPTS[:4], mixed)
    assert int8_drafted.engine.stats()["spec_num_drafts"] > before
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")


def test_server_with_a_draft_model_streams_the_same_answer(tiny_llama, plain):
    """`pagoda serve --speculative-config` with a draft model, through the openai SDK: streamed and
    whole answers (logprobs included) equal the engine's without speculation; a request may opt
    out in its body; /metrics shows acceptance per position."""
    import json

    import openai
    from pagoda.bench.servers import scrape_metrics
    from server_process import start_server

    spec = json.dumps(_draft(tiny_llama, quantization="int8"))
    proc, base = start_server(tiny_llama, "--speculative-config", spec, "--deterministic")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        prompt = PROMPTS[3]
        want = plain.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
        body = dict(model="tiny", prompt=prompt, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**body, logprobs=2)
        assert whole.choices[0].text == want and len(whole.choices[0].logprobs.tokens) == 30
        streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
        assert streamed == want
        before = scrape_metrics(base)["pagoda:spec_decode_num_drafts_total"]
        opted_out = client.completions.create(**{**body, "extra_body": {"ignore_eos": True, "speculative": False}})
        assert opted_out.choices[0].text == want
        metrics = scrape_metrics(base)
        assert metrics["pagoda:spec_decode_num_drafts_total"] == before > 0
        assert metrics["pagoda:spec_decode_num_accepted_tokens_per_pos_total"] > 0
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_draft_that_disagrees_changes_nothing(tiny_llama, other_llama, plain):
    llm = LLM(str(tiny_llama), speculative_config=_draft(other_llama), **ARGS)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert _tokens(llm, PROMPTS, params) == _tokens(plain, PROMPTS, params)
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 100 and stats["spec_acceptance_rate"] < 0.5


def test_a_request_whose_drafts_fail_stops_drafting(tiny_llama, other_llama, plain):
    """adaptive (the default): after a few rejected runs a request drafts nothing, but for one
    probe every PROBE_EVERY steps."""
    from pagoda.spec_decode.draft_model import PROBE_EVERY

    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    failing = LLM(str(tiny_llama), speculative_config=_draft(other_llama, adaptive=True), **ARGS)
    assert _tokens(failing, PROMPTS[:1], params) == _tokens(plain, PROMPTS[:1], params)
    stats = failing.engine.stats()
    assert stats["spec_num_drafts"] <= 4 + 96 // PROBE_EVERY, stats["spec_num_drafts"]
    assert stats["spec_draft_tokens_per_pos"][0] == stats["spec_num_drafts"]


def test_draft_length_follows_acceptance_and_cost():
    """The j-th draft is proposed while alpha^j >= draft pass time / target step time."""
    from pagoda.spec_decode.draft_model import PROBE_EVERY, DraftModelProposer

    proposer = DraftModelProposer.__new__(DraftModelProposer)  # the decision only: no model
    proposer.k, proposer.adaptive, proposer.acceptance, proposer.idle_steps = 5, True, {}, {}
    proposer.pass_seconds, proposer.step_seconds = 0.0, 0.0
    assert proposer.draft_length("r") == 5  # nothing measured yet: the full length
    proposer.pass_seconds, proposer.step_seconds = 0.004, 0.020  # a draft pass costs 0.2 of a step
    assert proposer.draft_length("r") == 5  # no verification yet: alpha = 1
    for _ in range(20):
        proposer.record_verification("r", 5, 5)
    assert proposer.draft_length("r") == 5
    for _ in range(20):
        proposer.record_verification("r", 5, 1)  # alpha ~ 0.5: 0.5, 0.25 pay at 0.2, 0.125 does not
    assert proposer.draft_length("r") == 2
    proposer.pass_seconds = 0.012  # 0.6 of a step: not even the first
    assert [proposer.draft_length("r") for _ in range(PROBE_EVERY)] == [0] * (PROBE_EVERY - 1) + [1]
    proposer.adaptive = False
    assert proposer.draft_length("r") == 5


def test_the_cost_is_a_median_with_a_floor():
    """One slow step does not move the measured cost; a pass timed as nearly free still costs
    MIN_COST, so a request whose drafts keep failing stops even on a host that skews timings."""
    from pagoda.spec_decode.draft_model import MIN_COST, DraftModelProposer

    proposer = DraftModelProposer(_NoModel(), torch.zeros(2, 0, 4), None, 16, torch.device("cpu"), 4)
    for seconds in (0.020, 0.021, 2.0, 0.019, 0.020):  # the third step waited for the host
        proposer.record_step(seconds)
    assert proposer.step_seconds == pytest.approx(0.020)
    proposer.pass_seconds = 0.0001  # timed as all but free
    proposer.record_verification("r", 4, 0)
    while proposer.acceptance["r"][0] / sum(proposer.acceptance["r"]) >= MIN_COST:
        assert proposer.draft_length("r") >= 1
        proposer.record_verification("r", 1, 0)
    assert proposer.draft_length("r") == 0


class _NoModel:
    """What the proposer's constructor reads of a draft model with no layers."""
    backend = None

    def attention_layers(self):
        return []


def test_prefix_cache_hits_are_hits_for_the_draft_too(tiny_llama, plain):
    """A second request with the same long prompt: the target reuses the cached blocks, and the
    draft its own K/V in them, so it computes only the uncached tail (counted in the proposer)."""
    llm = LLM(str(tiny_llama), speculative_config=_draft(tiny_llama), **ARGS)
    drafter = llm.engine.core.executor.driver_worker.runner.drafter
    prompt = "the quick brown fox jumps over the lazy dog " * 6
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = drafter.num_tokens_run
    assert _tokens(llm, [prompt], params) == _tokens(plain, [prompt], params)
    cold = drafter.num_tokens_run - first
    assert _tokens(llm, [prompt], params) == _tokens(plain, [prompt], params)
    warm = drafter.num_tokens_run - first - cold
    prompt_len = len(llm.get_tokenizer().encode(prompt))
    assert cold >= prompt_len and warm < cold - prompt_len // 2, (cold, warm, prompt_len)
    assert llm.engine.stats()["spec_acceptance_rate"] == 1.0  # the target as its own draft: every draft holds


def test_sampling_with_a_draft_keeps_the_target_distribution(tiny_llama):
    """Rejection sampling against an int8 draft: per position, the tokens follow the distribution
    they follow without speculation. Two samples of 1,200 seeded requests; their total variation
    must stay within what sampling noise gives between two plain samples with other seeds (x2 +
    0.03: a broken rule, e.g. accepting every draft, moves it by ~0.5)."""
    args = dict(dtype="float32", kv_cache_memory=0.05, enable_prefix_caching=False)
    plain = LLM(str(tiny_llama), **args)
    spec = LLM(str(tiny_llama), speculative_config=_draft(tiny_llama, quantization="int8", num_speculative_tokens=3),
               **args)
    prompts = PROMPTS[:1] * 1200

    def sample(llm: LLM, first_seed: int) -> np.ndarray:
        params = [SamplingParams(max_tokens=4, seed=first_seed + i, temperature=0.8, top_k=3, ignore_eos=True)
                  for i in range(len(prompts))]
        return np.array([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])

    def tv(a: np.ndarray, b: np.ndarray) -> float:
        return 0.5 * sum(abs((a == t).mean() - (b == t).mean()) for t in np.union1d(a, b))

    want, other, got = sample(plain, 0), sample(plain, 10**6), sample(spec, 0)
    stats = spec.engine.stats()
    assert stats["spec_accepted_tokens"] >= 100 and stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] >= 100
    for position in range(1, 4):  # the first token comes from the prompt's pass, never a draft
        noise = tv(want[:, position], other[:, position])
        assert tv(want[:, position], got[:, position]) < 2 * noise + 0.03, (position, noise)


def test_no_block_is_leaked_after_1000_random_requests(tiny_llama, other_llama):
    """Preemption (a tiny cache), chunked prefill, prefix hits, drafts accepted and rejected, stops
    inside runs: every block comes back, and every answer has its length."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.00012, max_num_batched_tokens=32,
              speculative_config=_draft(other_llama, num_speculative_tokens=3))
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "a", "b", "c", "hello", "world"]
    prompts = [" ".join(rng.choice(words[: rng.randint(2, 9)]) for _ in range(rng.randint(2, 40))) for _ in range(1000)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.7]), seed=i,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    core = llm.engine.core
    stats = core.scheduler.stats()
    assert core.scheduler.num_preemptions_total > 0 and stats.spec_draft_tokens > 0
    assert core.kv_manager.usage() == 0.0


@pytest.mark.parametrize("config,field", [
    ({"method": "draft_model"}, "model"),
    ({"method": "draft_model", "model": "/nonexistent/model"}, "speculative_config.model"),
    ({"method": "ngram", "model": "x"}, "model"),
    ({"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 6}, "num_speculative_tokens"),
    ({"method": "draft_model", "model": "DRAFT", "quantization": "int3"}, "quantization"),
])
def test_bad_draft_configs_name_the_field(tiny_llama, config, field):
    config = {k: (str(tiny_llama) if v == "DRAFT" else v) for k, v in config.items()}
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.01, speculative_config=config)


def test_a_draft_with_another_tokenizer_is_refused(tiny_llama, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.01, speculative_config=_draft(other))


def test_default_batch_size_limit_depends_on_the_method():
    """A draft model's passes grow with the batch: it drafts up to 2 running requests by default,
    prompt lookup up to 4 (benchmarks/README.md); an explicit value (null: always) is kept."""
    from pagoda.spec_decode.speculative_config import SpeculativeConfig

    assert SpeculativeConfig.parse({"method": "draft_model", "model": "m"}).disable_by_batch_size == 2
    assert SpeculativeConfig.parse({"method": "ngram"}).disable_by_batch_size == 4
    assert SpeculativeConfig.parse({"model": "m", "disable_by_batch_size": None}).disable_by_batch_size is None
