"""The scheduler on its own: no model, a fake step that 'samples' a token per finished chunk."""

from __future__ import annotations

import random
import time
from concurrent.futures import Future

import llguidance

from pagoda.core.kv_cache_manager import KVCacheManager, cdiv
from pagoda.core.request_order import BACKGROUND_PRIORITY
from pagoda.core.scheduler import Scheduler
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.outputs import ModelRunnerOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.structured_output import GrammarState, compile_grammar
from pagoda.structured_output.manager import allocate_token_bitmask


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=False):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)


def req(rid, n_prompt, max_tokens=4, priority=0, t=0.0) -> Request:
    return Request(rid, [1] * n_prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority, arrival_time=t)


def fake_step(sched: Scheduler, trace: list | None = None):
    out = sched.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = sched.requests[rid]
        assert r.num_computed_tokens + n <= r.num_tokens
        if r.num_computed_tokens + n == r.num_tokens:
            sampled[r.request_id] = [7]
    if trace is not None:
        trace.append(out)
    return out, sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled))


def churn(sched: Scheduler, rng: random.Random, arrivals: int, max_tokens: int):
    """Random arrivals (1-50 prompt tokens of the same token, so prefixes are shared; priorities
    0-2), an abort now and then, and a step most of the time: yields each step's SchedulerOutput."""
    live: list[Request] = []
    for added in range(arrivals):
        r = req(f"r{added}", rng.randint(1, 50), max_tokens=rng.randint(1, max_tokens), priority=rng.randint(0, 2),
                t=added)
        sched.add_request(r)
        live.append(r)
        if rng.random() < 0.05:
            sched.finish_request(rng.choice(live).request_id)
        if rng.random() < 0.7:
            out, _ = fake_step(sched)
            yield out
        live = [r for r in live if not r.status.finished]


def run_to_completion(sched: Scheduler, max_steps=10_000, trace=None) -> list[Request]:
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        _, done = fake_step(sched, trace)
        finished += done
    raise AssertionError("scheduler did not finish")


def test_fcfs_and_budget_and_chunked_prefill():
    sched = make_scheduler(budget=10)
    a, b = req("a", 25, t=0), req("b", 3, t=1)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = fake_step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 10)]  # a's prompt is chunked
    out, _ = fake_step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 10)]
    out, _ = fake_step(sched)
    # a's last 5 prompt tokens, then b joins in the same step with its whole prompt
    assert list(out.num_scheduled_tokens.items()) == [("a", 5), ("b", 3)]
    out, _ = fake_step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1)]  # decodes


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(5):
        sched.add_request(req(f"r{i}", 4, t=i))
    out, _ = fake_step(sched)
    assert len(out.num_scheduled_tokens) == 2 and sched.num_running == 2 and sched.num_waiting == 3


def test_priority_orders_waiting_queue_then_arrival():
    sched = make_scheduler(max_num_seqs=1, budget=100)
    sched.add_request(req("low", 4, priority=0, t=0))
    sched.add_request(req("high", 4, priority=5, t=1))
    sched.add_request(req("high2", 4, priority=5, t=2))
    order = []
    trace = []
    run_to_completion(sched, trace=trace)
    for out in trace:
        for rid in out.num_scheduled_tokens:
            if rid not in order:
                order.append(rid)
    assert order == ["high", "high2", "low"]


def test_preemption_picks_lowest_priority_latest_arrival_and_everything_finishes():
    # 6 blocks of 4 tokens; three requests that each grow to 4 blocks cannot run together.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    reqs = [req("a", 6, max_tokens=10, priority=1, t=0), req("b", 6, max_tokens=10, priority=0, t=1),
            req("c", 6, max_tokens=10, priority=0, t=2)]
    for r in reqs:
        sched.add_request(r)
    trace = []
    finished = run_to_completion(sched, trace=trace)
    preempted = [rid for out in trace for rid in out.preempted_req_ids]
    assert preempted, "the tiny cache must force preemption"
    assert preempted[0] == "c"  # lowest priority, latest arrival goes first
    assert "a" not in preempted  # highest priority is never the victim here
    assert {r.request_id for r in finished} == {"a", "b", "c"}
    assert all(r.num_output_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH for r in finished)
    assert sched.kv.num_free_blocks == 6


def test_abort_frees_every_block():
    sched = make_scheduler(num_blocks=16, block_size=4)
    a, b = req("a", 10, max_tokens=50), req("b", 10, max_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):
        fake_step(sched)
    assert sched.kv.num_free_blocks < 16
    sched.finish_request("a")
    sched.finish_request("b")
    assert sched.kv.num_free_blocks == 16 and not sched.has_unfinished_requests()
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == []


def test_abort_of_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(req("a", 4))
    sched.add_request(req("b", 4))
    fake_step(sched)
    sched.finish_request("b")
    assert sched.num_waiting == 0
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 64


def test_no_leaked_block_after_1000_random_requests():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=48, block_size=4, max_num_seqs=16, budget=40, max_model_len=128)
    live: list[Request] = []
    added = 0
    finished_total = 0
    aborted = 0
    while added < 1000 or sched.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):
            if added < 1000:
                r = req(f"r{added}", rng.randint(1, 60), max_tokens=rng.randint(1, 20), priority=rng.randint(0, 2), t=added)
                sched.add_request(r)
                live.append(r)
                added += 1
        if live and rng.random() < 0.05:  # random aborts
            aborted += sched.finish_request(rng.choice(live).request_id) is not None
        out, done = fake_step(sched)
        assert out.total_num_scheduled_tokens <= 40
        assert sched.num_running <= 16
        held = sum(len(r.block_ids) for r in sched.running)
        assert held == 48 - sched.kv.num_free_blocks  # every used block belongs to a running request
        for r in sched.running:
            assert len(r.block_ids) >= cdiv(r.num_computed_tokens, 4)
        finished_total += len(done)
        live = [r for r in live if not r.status.finished]
    assert sched.kv.num_free_blocks == 48
    assert finished_total + aborted == 1000 and aborted > 0


def test_high_priority_arrival_preempts_low_priority_running():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    sched.add_request(req("low-a", 4, max_tokens=50, priority=0, t=time.monotonic()))
    sched.add_request(req("low-b", 4, max_tokens=50, priority=1, t=time.monotonic()))
    fake_step(sched)
    fake_step(sched)
    assert {r.request_id for r in sched.running} == {"low-a", "low-b"}
    sched.add_request(req("vip", 4, max_tokens=3, priority=10, t=time.monotonic()))
    out, _ = fake_step(sched)
    assert out.preempted_req_ids == ["low-a"]  # the lowest-priority running request makes room
    assert "vip" in list(out.num_scheduled_tokens)
    finished = run_to_completion(sched)
    assert [r.request_id for r in finished][0] == "vip"
    assert {r.request_id for r in finished} == {"vip", "low-a", "low-b"}
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in finished)


def test_background_work_sits_out_the_steps_that_compute_an_interactive_prompt():
    """Batch lines (priority BACKGROUND_PRIORITY) decode while nothing else prefills; a step
    that computes an interactive prompt is the prompt's alone, so its first token waits for no
    batch decode; then both decode together, and everything finishes."""
    sched = make_scheduler(max_num_seqs=8, budget=8)
    for i in range(3):
        sched.add_request(req(f"batch-{i}", 2, max_tokens=20, priority=BACKGROUND_PRIORITY, t=i))
    for _ in range(3):
        out, _ = fake_step(sched)
    assert set(out.num_scheduled_tokens) == {"batch-0", "batch-1", "batch-2"}  # decoding, alone
    sched.add_request(req("chat", 12, max_tokens=3, t=10))  # a prompt of two chunks of the budget
    for _ in range(2):
        out, _ = fake_step(sched)
        assert list(out.num_scheduled_tokens) == ["chat"]  # its prefill chunks: the batch waits
    out, _ = fake_step(sched)
    assert set(out.num_scheduled_tokens) == {"chat", "batch-0", "batch-1", "batch-2"}  # decodes share steps
    assert not out.preempted_req_ids
    finished = run_to_completion(sched)
    assert {r.request_id for r in finished} == {"chat", "batch-0", "batch-1", "batch-2"}


def test_equal_priority_arrival_does_not_preempt():
    sched = make_scheduler(max_num_seqs=1, budget=100)
    now = time.monotonic()
    sched.add_request(req("first", 4, max_tokens=5, t=now))
    fake_step(sched)
    sched.add_request(req("second", 4, max_tokens=5, t=now))
    trace = []
    run_to_completion(sched, trace=trace)
    assert not any(out.preempted_req_ids for out in trace)


def test_starvation_guard_ages_old_low_priority_requests():
    sched = make_scheduler(max_num_seqs=1, budget=100)
    sched.order.aging_seconds = 10.0
    now = time.monotonic()
    sched.add_request(req("old-low", 4, max_tokens=2, priority=0, t=now - 60))  # aged 6 levels
    sched.add_request(req("new-mid", 4, max_tokens=2, priority=3, t=now))
    sched.add_request(req("new-high", 4, max_tokens=2, priority=9, t=now))
    order = [r.request_id for r in run_to_completion(sched)]
    assert order == ["new-high", "old-low", "new-mid"]  # 0 + 6 > 3, but < 9


def test_pressure_blocks_admissions_that_would_force_preemption():
    # 10 blocks of 4 tokens; two running requests fill most of the cache and keep growing.
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=8, budget=100)
    sched.admission_pressure_threshold = 0.5
    now = time.monotonic()
    for name in ("a", "b"):
        sched.add_request(req(name, 16, max_tokens=4, t=now))  # grows to 5 blocks each: all 10
    fake_step(sched)  # 8 of 10 blocks used: pressure 0.8
    sched.add_request(req("c", 4, max_tokens=2, t=now + 1))
    out, _ = fake_step(sched)
    assert "c" not in list(out.num_scheduled_tokens)  # 1 free block < 2 running: wait
    trace = []
    finished = run_to_completion(sched, trace=trace)
    assert not any(o.preempted_req_ids for o in trace)
    assert {r.request_id for r in finished} == {"a", "b", "c"}


def test_no_leaked_block_with_prefix_caching_under_churn():
    """Shared prompts (all tokens alike), preemption, aborts and eviction: every reference is
    accounted for, and once the cache is dropped every block is free again."""
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=12, budget=40, max_model_len=128, caching=True)
    for out in churn(sched, rng, arrivals=600, max_tokens=16):
        assert out.total_num_scheduled_tokens <= 40
    run_to_completion(sched)
    kv = sched.kv
    assert kv.prefix_hit_tokens > 0
    assert kv.num_free_blocks == 40  # cached blocks count as free: nobody holds them
    kv.reset_prefix_cache()
    assert kv.pool.num_free_blocks == 40 and kv.cache.num_cached_blocks == 0


def test_a_request_waits_for_its_grammar_without_holding_up_others():
    """A constrained request is passed over while its grammar compiles; once compiled it runs,
    and it stops as soon as its grammar is complete (here after the one token 7 = "x")."""
    class Vocab:  # llguidance's tokenizer protocol: token 7 is "x", 8 the stop token
        eos_token_id, bos_token_id, special_token_ids = 8, None, [8]
        tokens = [b"a"] * 7 + [b"x", b"</s>"]

        def __call__(self, text: str) -> list[int]:
            return [7] * len(text)

    sched = make_scheduler()
    constrained, free = req("constrained", 5, max_tokens=10, t=0.0), req("free", 5, t=1.0)
    compiling: Future = Future()
    sched.add_request(constrained, GrammarState(compiling))
    sched.add_request(free)
    out, _ = fake_step(sched)
    assert list(out.num_scheduled_tokens) == ["free"]
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()), n_vocab=9)
    compiling.set_result(compile_grammar(tokenizer, StructuredOutputsParams(regex="x")))
    out, _ = fake_step(sched)
    assert "constrained" in list(out.num_scheduled_tokens)
    assert constrained.output_token_ids == [7] and constrained.status == RequestStatus.RUNNING
    # After "x" only the stop token is allowed; accepting it completes the grammar.
    bitmask = allocate_token_bitmask(1, 9)
    constrained.grammar.fill_bitmask(bitmask, 0)
    allowed = [t for t in range(9) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == [8]
    sched.update(SchedulerOutput(num_scheduled_tokens={"constrained": 1}), ModelRunnerOutput({"constrained": [8]}))
    assert constrained.status == RequestStatus.FINISHED_STOPPED


def test_prefix_cache_counters_count_each_admitted_request_once_under_pressure():
    """The issue's case at the scheduler level: a tiny cache, 8 sequence slots, 4 concurrent
    100-token prompts (a shared 48-token head). Requests wait for blocks over many steps and get
    preempted; the queries are still exactly the prompt tokens sent, each request counted when
    it is admitted, and the hits exactly what the requests were given."""
    block_size, head = 16, list(range(100, 148))
    sched = make_scheduler(num_blocks=12, block_size=block_size, max_num_seqs=8, budget=64, max_model_len=512,
                           caching=True)
    prompts = [head + [1000 * (i + 1) + j for j in range(52)] for i in range(4)]
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True), arrival_time=i)
                for i, p in enumerate(prompts)]
    for r in requests:
        sched.add_request(r)
    waited_steps = 0
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        fake_step(sched)
        waited_steps += sched.num_waiting
    else:
        raise AssertionError("scheduler did not finish")
    stats = sched.stats()
    assert waited_steps > 10 and sched.num_preemptions_total > 0  # the pressure really happened
    assert stats.prefix_cache_query_tokens == sum(len(p) for p in prompts) == 400
    assert stats.prefix_cache_hit_tokens == sum(r.num_cached_tokens for r in requests) > 0
    assert 0 < stats.prefix_cache_hit_rate < 1
    assert stats.prefix_cache_preempted_query_tokens > 0  # resumed requests, counted apart
