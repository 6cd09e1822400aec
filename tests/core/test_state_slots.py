"""State-space models' recurrent-state slots: the allocator, and the scheduler handing one to
each running request and taking it back on preemption, finish and abort (no model: a fake step
samples a token per finished chunk)."""

from __future__ import annotations

import pytest

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.core.state_slots import StateSlots
from test_scheduler import fake_step, req


def make(num_slots: int, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                     max_model_len=256, states=StateSlots(num_slots))


def held(sched: Scheduler) -> dict[str, int]:
    return {r.request_id: r.state_slot for r in sched.running}


def test_slots_are_handed_out_once_and_taken_back():
    slots = StateSlots(2)
    a, b = slots.allocate("a"), slots.allocate("b")
    assert {a, b} == {0, 1} and slots.allocate("c") is None and slots.num_free == 0
    assert slots.holder(a) == "a"
    slots.free(a)
    assert slots.num_free == 1 and slots.allocate("c") == a
    slots.free(None)  # a request that held none
    with pytest.raises(ValueError):
        slots.free(7)
    with pytest.raises(ValueError):
        StateSlots(0)


def test_running_requests_hold_distinct_slots_and_admission_waits_for_one():
    sched = make(num_slots=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", 5, max_tokens=3))
    out, _ = fake_step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}  # no slot for the third
    assert sorted(held(sched).values()) == [0, 1]
    assert {n.req_id: n.state_slot for n in out.new_requests} == held(sched)
    finished = []
    while sched.has_unfinished_requests():
        _, done = fake_step(sched)
        finished += done
    assert len(finished) == 3 and sched.states.num_free == 2
    assert all(r.state_slot is None for r in finished)


def test_abort_frees_the_slot():
    sched = make(num_slots=2)
    sched.add_request(req("a", 5, max_tokens=10))
    fake_step(sched)
    assert sched.states.num_free == 1
    sched.finish_request("a")
    assert sched.states.num_free == 2
    sched.add_request(req("waiting", 5))  # aborted before it ever ran: it held none
    sched.finish_request("waiting")
    assert sched.states.num_free == 2


def test_preemption_frees_the_slot_and_the_resumed_request_gets_one_again():
    """8 blocks of 4 tokens: two requests growing to 16 tokens each cannot both stay; the one
    preempted gives its slot back, and its resumption carries the slot it runs in then."""
    sched = make(num_slots=2, num_blocks=8)
    sched.add_request(req("a", 12, max_tokens=8, t=0.0))
    sched.add_request(req("b", 12, max_tokens=8, t=1.0))
    resumed = []
    while sched.has_unfinished_requests():
        out, _ = fake_step(sched)
        assert sched.states.num_free == sched.states.num_slots - len(sched.running)
        assert len(set(held(sched).values())) == len(sched.running)
        resumed += [(c.req_id, c.state_slot) for c in out.cached_requests if c.resumed_from_preemption]
    assert sched.num_preemptions_total > 0 and resumed
    assert all(slot in (0, 1) for _, slot in resumed)
    assert sched.states.num_free == 2
