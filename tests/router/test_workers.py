"""Circuit breaker, warm-up ramp and the registry's passive failure handling (no network)."""

from __future__ import annotations

import pytest

from fakes import FakeClock
from pagoda.router.workers import MIN_WEIGHT, BreakerState, CircuitBreaker, WorkerRegistry, normalize_url


def test_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, open_seconds=10, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # the count is of failures in a row
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allows_request()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allows_request()


def test_breaker_half_opens_for_one_trial_then_closes_or_reopens():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, open_seconds=10, clock=clock)
    breaker.record_failure()
    clock.advance(9.9)
    assert not breaker.allows_request()
    clock.advance(0.1)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows_request()
    assert breaker.on_dispatch() is True  # the trial
    assert not breaker.allows_request()  # only one at a time
    assert breaker.on_dispatch() is False
    breaker.record_failure()  # the trial failed: open again, for a full period
    assert breaker.state is BreakerState.OPEN
    clock.advance(10)
    assert breaker.on_dispatch() is True
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allows_request()


def test_an_abandoned_trial_lets_another_request_try():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, open_seconds=1, clock=clock)
    breaker.record_failure()
    clock.advance(1)
    assert breaker.on_dispatch()
    breaker.abandon_trial()
    assert breaker.allows_request() and breaker.state is BreakerState.HALF_OPEN


def test_warmup_ramps_the_weight_from_the_floor_to_one():
    clock = FakeClock()
    registry = WorkerRegistry(warmup_seconds=100, clock=clock)
    worker = registry.add("http://127.0.0.1:1")
    assert worker.weight() == 0 and not worker.available  # not probed yet
    worker.mark_up()
    assert worker.weight() == MIN_WEIGHT
    clock.advance(50)
    assert worker.weight() == pytest.approx(0.5)
    clock.advance(60)
    assert worker.weight() == 1.0
    worker.mark_down("probe failed")
    assert worker.weight() == 0 and not worker.available
    worker.mark_up()  # it recovered: a fresh ramp
    assert worker.weight() == MIN_WEIGHT


def test_workers_the_router_starts_with_are_not_warmed_up():
    registry = WorkerRegistry(warmup_seconds=100, clock=FakeClock())
    worker = registry.add("http://127.0.0.1:1")
    worker.mark_up(warm=False)
    assert worker.weight() == 1.0


def test_refused_connection_takes_a_worker_out_at_once_other_failures_through_the_breaker():
    registry = WorkerRegistry(failure_threshold=2, clock=FakeClock())
    a, b = registry.add("http://127.0.0.1:1"), registry.add("http://127.0.0.1:2/")
    assert b.url == "http://127.0.0.1:2"
    a.mark_up(), b.mark_up()
    registry.record_failure(a, "connection refused", refused=True)
    assert not a.healthy and registry.available() == [b]
    registry.record_failure(b, "read timeout")
    assert b.available
    registry.record_failure(b, "read timeout")
    assert not b.available and b.healthy and b.breaker.state is BreakerState.OPEN
    assert registry.available() == []


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "ftp://x", "http://", ""])
def test_worker_urls_must_be_http(bad):
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        normalize_url(bad)
