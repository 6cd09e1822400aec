"""Token buckets and the gateway's three limits (overall QPS, per-key QPS, requests in flight)."""

from __future__ import annotations

import pytest

from fakes import FakeClock
from pagoda.router.limits import GatewayLimits, TokenBucket


def test_bucket_allows_its_burst_then_refills_at_its_rate():
    clock = FakeClock()
    bucket = TokenBucket(rate=2, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0, 0, 0]
    assert bucket.take() == pytest.approx(0.5)  # the next token in 1/rate seconds
    clock.advance(0.25)
    assert bucket.take() == pytest.approx(0.25)
    clock.advance(0.25)
    assert bucket.take() == 0
    clock.advance(100)  # refill stops at the burst
    assert [bucket.take() for _ in range(4)].count(0) == 3


def test_bucket_rejects_a_non_positive_rate():
    with pytest.raises(ValueError):
        TokenBucket(0)


def test_per_key_limit_is_per_key():
    limits = GatewayLimits(qps_per_key=1, clock=FakeClock())
    assert limits.admit("alice") is None
    refused = limits.admit("alice")
    assert refused.level == "key_qps" and refused.retry_after_header == "1"
    assert limits.admit("bob") is None  # bob has his own bucket
    assert limits.in_flight == 2


def test_overall_limit_refuses_everyone_and_gives_back_the_key_token():
    clock = FakeClock()
    limits = GatewayLimits(qps=2, qps_per_key=5, clock=clock)
    assert limits.admit("a") is None and limits.admit("b") is None
    refused = limits.admit("c")
    assert refused.level == "global_qps" and "service" in refused.message
    assert limits._per_key["c"].tokens == pytest.approx(5)  # c's token was returned


def test_in_flight_bound_holds_until_a_release():
    limits = GatewayLimits(max_in_flight=2, clock=FakeClock())
    assert limits.admit("") is None and limits.admit("") is None
    refused = limits.admit("")
    assert refused.level == "in_flight" and refused.retry_after_header == "1"
    limits.release()
    assert limits.admit("") is None


def test_retry_after_is_whole_seconds_rounded_up():
    clock = FakeClock()
    limits = GatewayLimits(qps=0.2, clock=clock)  # one request per 5 s
    assert limits.admit("") is None
    assert limits.admit("").retry_after_header == "5"
    clock.advance(3.5)
    assert limits.admit("").retry_after_header == "2"


def test_no_limits_admits_everything():
    limits = GatewayLimits()
    assert all(limits.admit("k") is None for _ in range(1000))
