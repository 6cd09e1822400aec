"""vLLM's chunking and policy knobs: --long-prefill-token-threshold, --max-num-partial-prefills,
--max-long-partial-prefills and --scheduling-policy, on the scheduler alone (the fake step of
test_scheduler.py) and through the engine (the same greedy tokens whatever the knobs)."""

from __future__ import annotations

import random
import time

import pytest

from pagoda.config import create_engine_config
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.prefill_chunks import PrefillChunking, resolve_long_prefill_threshold
from pagoda.core.scheduler import Scheduler
from pagoda.engine_args import EngineArgs
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

from test_scheduler import churn, fake_step, req, run_to_completion


def make(budget=32, threshold=0, partial=1, long=1, policy="priority", num_blocks=64, block_size=4,
         max_num_seqs=8, caching=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256,
                     policy=policy, chunking=PrefillChunking(threshold, partial, long))


def steps(sched: Scheduler, n: int) -> list[list[tuple[str, int]]]:
    return [list(fake_step(sched)[0].num_scheduled_tokens.items()) for _ in range(n)]


def test_the_threshold_caps_every_prefill_but_not_decodes():
    sched = make(budget=32, threshold=8, partial=4, long=4)
    for rid, n in (("a", 20), ("b", 12)):
        sched.add_request(req(rid, n, max_tokens=3))
    assert steps(sched, 3) == [
        [("a", 8), ("b", 8)],  # both long prompts cut at 8, though the budget has room
        [("a", 8), ("b", 4)],  # b's prompt finishes
        [("a", 4), ("b", 1)],  # ...and b decodes one token a step
    ]


def test_one_partial_prefill_at_a_time_lets_prompts_that_fit_go_past():
    sched = make(budget=32, threshold=8, partial=1, long=1)
    for rid, n, t in (("a", 20, 0), ("b", 20, 1), ("c", 5, 2)):
        sched.add_request(req(rid, n, max_tokens=4, t=t))
    assert steps(sched, 3) == [
        [("a", 8), ("c", 5)],  # b would be left mid-prefill too: it waits, c's whole prompt fits
        [("a", 8), ("c", 1)],
        [("a", 4), ("c", 1), ("b", 8)],  # a finishes its prompt: b takes the slot
    ]


def test_max_long_partial_prefills_keeps_a_slot_for_a_short_prompt():
    def first_step(long: int) -> list[tuple[str, int]]:
        sched = make(budget=12, threshold=8, partial=2, long=long)
        for rid, n, t in (("a", 20, 0), ("b", 20, 1), ("c", 6, 2)):
            sched.add_request(req(rid, n, t=t))
        return steps(sched, 1)[0]

    assert first_step(long=2) == [("a", 8), ("b", 4)]  # two long prompts share the budget
    assert first_step(long=1) == [("a", 8), ("c", 4)]  # the second slot only for a short one: c passes b


def test_the_defaults_leave_at_most_the_request_at_the_budgets_end_mid_prefill():
    sched = make(budget=10)
    for rid, n, t in (("a", 4, 0), ("b", 4, 1), ("c", 30, 2), ("d", 3, 3)):
        sched.add_request(req(rid, n, max_tokens=4, t=t))
    assert steps(sched, 2) == [[("a", 4), ("b", 4), ("c", 2)], [("a", 1), ("b", 1), ("c", 8)]]


@pytest.mark.parametrize("knobs", [
    dict(threshold=0, partial=1, long=1), dict(threshold=6, partial=1, long=1), dict(threshold=6, partial=3, long=1),
    dict(threshold=16, partial=4, long=4, policy="fcfs"),
])
@pytest.mark.parametrize("caching", [False, True])
def test_the_limits_hold_every_step_under_churn(knobs, caching):
    """Random prompts (alike, so prefix hits), priorities, a cache small enough to preempt, aborts:
    every step respects the budget, the threshold and the partial-prefill limits, and every block
    comes back."""
    rng = random.Random(7)
    sched = make(budget=24, num_blocks=24, block_size=4, max_num_seqs=12, caching=caching, **knobs)
    chunking = sched.chunking
    threshold = chunking.long_prefill_token_threshold
    for out in churn(sched, rng, arrivals=400, max_tokens=12):
        assert out.total_num_scheduled_tokens <= 24
        if threshold:
            assert all(n <= threshold for n in out.num_scheduled_tokens.values())
        mid = [r for r in sched.running if r.num_tokens - r.num_computed_tokens > 1]
        assert len(mid) <= chunking.max_num_partial_prefills
        # long as the scheduler saw it: the tokens it had left when scheduled, after any prefix hit
        left_when_scheduled = [r.num_tokens - r.num_computed_tokens + out.num_scheduled_tokens.get(r.request_id, 0)
                               for r in mid]
        assert sum(map(chunking.is_long, left_when_scheduled)) <= chunking.max_long_partial_prefills
    finished = run_to_completion(sched)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in finished)
    assert sched.num_preemptions_total > 0 and sched.kv.num_free_blocks == 24


def test_fcfs_ignores_priorities():
    def order(policy: str) -> tuple[list[str], int]:
        sched = make(budget=100, max_num_seqs=1, policy=policy)
        now = time.monotonic()
        sched.add_request(req("low", 4, max_tokens=30, priority=0, t=now))
        fake_step(sched)  # low is running
        sched.add_request(req("mid", 4, max_tokens=2, priority=3, t=now + 1))
        sched.add_request(req("vip", 4, max_tokens=2, priority=9, t=now + 2))
        return [r.request_id for r in run_to_completion(sched)], sched.num_preemptions_total

    assert order("priority") == (["vip", "mid", "low"], 1)  # vip preempts low, then outranks mid
    assert order("fcfs") == (["low", "mid", "vip"], 0)  # arrival only: nobody is preempted


def test_speculative_drafts_are_verified_beside_a_capped_prefill():
    """The threshold cuts prefills, not a decoding request's drafts (which share the budget)."""
    sched = make(budget=32, threshold=4, partial=1, long=1)
    sched.add_request(req("spec", 3, max_tokens=20))
    fake_step(sched)
    sched.running[0].spec_token_ids = [5, 6, 7, 8, 9]
    sched.add_request(req("long", 20))
    out = sched.schedule()
    assert dict(out.num_scheduled_tokens) == {"spec": 6, "long": 4}
    assert out.scheduled_spec_tokens == {"spec": [5, 6, 7, 8, 9]}


def test_prefix_hits_count_from_the_uncached_tokens():
    """A prompt whose head is cached is cut at the threshold from where the cache ends."""
    sched = make(budget=64, threshold=8, partial=1, long=1, caching=True)
    prompt = list(range(10, 42))  # 32 tokens: 8 blocks
    sched.add_request(Request("first", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    run_to_completion(sched)
    sched.add_request(Request("again", prompt + [3] * 12, SamplingParams(max_tokens=1, ignore_eos=True)))
    out, _ = fake_step(sched)
    again = sched.requests["again"]
    assert again.num_cached_tokens == 32 and out.num_scheduled_tokens == {"again": 8}


@pytest.mark.parametrize(("knobs", "message"), [
    ((-1, 1, 1), "long_prefill_token_threshold must be >= 0"),
    ((0, 0, 1), "max_num_partial_prefills must be >= 1"),
    ((0, 2, 3), r"max_long_partial_prefills must be >= 1 and <= max_num_partial_prefills \(2\)"),
    ((0, 2, 0), "max_long_partial_prefills must be >= 1"),
])
def test_bad_knobs_are_refused_with_their_name(knobs, message):
    with pytest.raises(ValueError, match=message):
        PrefillChunking(*knobs)
    threshold, partial, long = knobs
    with pytest.raises(ValueError, match=message):
        EngineArgs(long_prefill_token_threshold=threshold, max_num_partial_prefills=partial,
                   max_long_partial_prefills=long)._validate()


def test_a_bad_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        make(policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineArgs(scheduling_policy="lifo")._validate()


def test_the_flags_reach_the_config(tiny_llama):
    from pagoda.cli import build_parser

    parser = build_parser()
    args = EngineArgs.from_cli_args(parser.parse_args([
        "serve", "--model", str(tiny_llama), "--long-prefill-token-threshold", "64", "--max-num-partial-prefills", "4",
        "--max-long-partial-prefills", "2", "--scheduling-policy", "fcfs"]))
    sc = create_engine_config(args).scheduler
    assert (sc.long_prefill_token_threshold, sc.max_num_partial_prefills, sc.max_long_partial_prefills,
            sc.policy) == (64, 4, 2, "fcfs")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--scheduling-policy", "lifo"])
    # vLLM's default: several partial prefills and no threshold make 4 % of the context long
    assert resolve_long_prefill_threshold(0, 4, 8192) == 327 and resolve_long_prefill_threshold(0, 1, 8192) == 0


PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((60, 9, 33, 75, 4, 41))]
PROMPTS.append(PROMPTS[0][:48] + [9] * 20)  # a prefix hit on the first prompt


@pytest.mark.parametrize("knobs", [
    dict(long_prefill_token_threshold=8, max_num_partial_prefills=1),
    dict(long_prefill_token_threshold=5, max_num_partial_prefills=3, max_long_partial_prefills=2,
         scheduling_policy="fcfs", kv_cache_memory=0.00008),  # 10 blocks: preemption
    dict(long_prefill_token_threshold=8, max_num_partial_prefills=2,
         speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}),
])
def test_the_knobs_do_not_change_greedy_tokens(tiny_llama, knobs):
    """Chunking chooses when a prompt's tokens are computed, never what comes out: the same
    greedy tokens as the default scheduling, with prefix hits, preemption and drafts."""
    from pagoda import LLM

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = dict(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.002, max_num_batched_tokens=24,
                deterministic=True)

    def tokens(**extra) -> tuple[list[list[int]], LLM]:
        llm = LLM(**{**base, **extra})
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm

    want, _ = tokens()
    got, llm = tokens(**knobs)
    assert got == want
    core = llm.engine.core
    assert core.kv_manager.usage() == 0.0
    if "kv_cache_memory" in knobs:
        assert core.scheduler.num_preemptions_total > 0
    if "speculative_config" in knobs:
        assert core.scheduler.stats().spec_draft_tokens > 0
