"""Routing policies over in-memory workers: rotation, load, stickiness, warm-up, cache awareness."""

from __future__ import annotations

from collections import Counter

import pytest

from fakes import FakeClock
from pagoda.router.affinity import RouteRequest
from pagoda.router.policies import CacheAware, ConsistentHash, LeastLoad, RoundRobin, make_policy
from pagoda.router.workers import Worker, WorkerRegistry


def _workers(n: int, clock: FakeClock | None = None, warmup: float = 0) -> list[Worker]:
    registry = WorkerRegistry(warmup_seconds=warmup, clock=clock or FakeClock())
    workers = [registry.add(f"http://127.0.0.1:{9000 + i}") for i in range(n)]
    for w in workers:
        w.mark_up(warm=False)
    return workers


def _request(prompt: str = "", session: str | None = None, derived: str | None = None) -> RouteRequest:
    return RouteRequest(session_key=session, derived_key=derived or f"prefix:{prompt}", prompt_text=prompt)


def _with_ring(policy, workers):
    for w in workers:
        policy.add_worker(w.url)
    return policy


def test_round_robin_rotates_and_a_warming_worker_gets_its_weight():
    clock = FakeClock()
    workers = _workers(2, clock)
    policy = RoundRobin()
    assert [policy.choose(_request(), workers).worker for _ in range(4)] == workers * 2
    newcomer = WorkerRegistry(warmup_seconds=100, clock=clock).add("http://127.0.0.1:9999")
    newcomer.mark_up()
    clock.advance(15)  # weight 0.15
    counts = Counter(policy.choose(_request(), [*workers, newcomer]).worker.url for _ in range(2150))
    assert counts[newcomer.url] == pytest.approx(2150 * 0.15 / 2.15, abs=2)


def test_least_load_prefers_idle_workers_and_rotates_ties():
    workers = _workers(3)
    policy = LeastLoad()
    assert {policy.choose(_request(), workers).worker.url for _ in range(3)} == {w.url for w in workers}
    workers[0].in_flight, workers[1].in_flight = 5, 1
    assert all(policy.choose(_request(), workers).worker is workers[2] for _ in range(5))
    assert policy.choose(_request(), workers).reason == "load"


def test_consistent_hash_sticks_and_falls_over_to_the_next_on_the_ring():
    workers = _workers(3)
    policy = _with_ring(ConsistentHash(), workers)
    owners = {s: policy.choose(_request(session=s), workers).worker for s in map(str, range(300))}
    assert all(policy.choose(_request(session=s), workers).worker is owners[s] for s in owners)
    assert len(set(owners.values())) == 3
    down = workers[0]
    survivors = [w for w in workers if w is not down]
    moved = {s: policy.choose(_request(session=s), survivors).worker for s in owners}
    # only the sessions of the missing worker move, the others keep theirs
    assert all(moved[s] is owners[s] for s in owners if owners[s] is not down)
    assert all(moved[s] is not down for s in owners)
    assert policy.choose(_request(session="x"), workers).reason == "session"
    assert policy.choose(_request(derived="prefix:abc"), workers).reason == "hash"


def test_consistent_hash_warmup_admits_a_growing_fixed_set_of_keys():
    clock = FakeClock()
    workers = _workers(1, clock)
    newcomer = WorkerRegistry(warmup_seconds=100, clock=clock).add("http://127.0.0.1:9999")
    newcomer.mark_up()
    policy = _with_ring(ConsistentHash(), [*workers, newcomer])
    keys = [f"s{i}" for i in range(2000)]

    def taken() -> set[str]:
        return {k for k in keys if policy.choose(_request(session=k), [*workers, newcomer]).worker is newcomer}

    clock.advance(20)
    early = taken()
    clock.advance(30)
    middle = taken()
    clock.advance(100)
    full = taken()
    assert early < middle < full  # the keys it took stay with it as the ramp grows
    assert len(early) == pytest.approx(0.2 * len(full), rel=0.25)
    assert len(full) == pytest.approx(len(keys) / 2, rel=0.15)


def test_cache_aware_sends_a_shared_prefix_family_to_one_worker():
    workers = _workers(2)
    policy = _with_ring(CacheAware(), workers)
    system = "You are a helpful assistant that answers questions about geography. " * 2
    family_a = [system + f"Question {i}?" for i in range(6)]
    other = "Completely different text about cooking pasta and sauces, at length. " * 2
    chosen_a = []
    for prompt in family_a:
        d = policy.choose(_request(prompt), workers)
        policy.routed(_request(prompt), d.worker)
        chosen_a.append(d)
    assert len({d.worker.url for d in chosen_a}) == 1
    assert chosen_a[0].reason == "load" and all(d.reason == "prefix" for d in chosen_a[1:])
    assert chosen_a[1].matched_chars >= len(system)
    d = policy.choose(_request(other), workers)  # no match: least-loaded (the tie rotates)
    assert d.reason == "load"


def test_cache_aware_load_wins_when_imbalanced_and_sessions_stick():
    workers = _workers(2)
    policy = _with_ring(CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5), workers)
    prompt = "shared prefix " * 10
    first = policy.choose(_request(prompt), workers).worker
    policy.routed(_request(prompt), first)
    first.in_flight = 10
    d = policy.choose(_request(prompt), workers)
    assert d.reason == "load" and d.worker is not first
    s = policy.choose(_request(prompt, session="abc"), workers)
    assert s.reason == "session"
    assert all(policy.choose(_request(f"p{i}", session="abc"), workers).worker is s.worker for i in range(20))


def test_cache_aware_forgets_a_removed_worker():
    workers = _workers(2)
    policy = _with_ring(CacheAware(), workers)
    policy.routed(_request("hello world"), workers[0])
    policy.remove_worker(workers[0].url)
    assert policy.tree.match("hello world") == {}


def test_make_policy_names():
    assert {make_policy(n).name for n in ("cache_aware", "consistent_hash", "least_load", "round_robin")} == {
        "cache_aware", "consistent_hash", "least_load", "round_robin"}
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
