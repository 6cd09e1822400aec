"""The load forecaster (pagoda/router/forecast.py): Holt-Winters tracks a seasonal load better than
the last value does, deterministically, and the replicas it asks for follow the forecast."""

from __future__ import annotations

import math
import random

import pytest

from pagoda.router.forecast import ForecastConfig, HoltWinters, LoadForecaster, replicas_for, requested_tokens

SEASON = 48  # samples per "day"


def _diurnal(n: int, seed: int = 7) -> list[float]:
    """A day-shaped rate (night trough, afternoon peak) with a slow growth and seeded noise."""
    rng = random.Random(seed)
    return [max(0.0, 10 + 8 * math.sin(2 * math.pi * t / SEASON) + 0.02 * t + rng.gauss(0, 0.8)) for t in range(n)]


def _errors(trace: list[float], h: int, start: int) -> tuple[float, float]:
    """Mean absolute error h samples ahead, from `start` on: Holt-Winters', the last value's."""
    hw = HoltWinters(SEASON)
    ours, naive = [], []
    for t, x in enumerate(trace[:-h]):
        hw.update(x)
        if t >= start:
            ours.append(abs(hw.forecast(h) - trace[t + h]))
            naive.append(abs(x - trace[t + h]))
    return sum(ours) / len(ours), sum(naive) / len(naive)


@pytest.mark.parametrize("h", [1, 4, 8])
def test_it_tracks_a_seasonal_load_better_than_the_last_value(h):
    trace = _diurnal(6 * SEASON)
    ours, naive = _errors(trace, h, start=2 * SEASON)  # scored after one season to learn it from
    assert ours < naive
    if h >= 4:  # the lead times that matter for scaling: a clear margin, not noise
        assert ours < 0.6 * naive, (ours, naive)


def test_it_is_deterministic():
    trace = _diurnal(3 * SEASON)
    a, b = HoltWinters(SEASON), HoltWinters(SEASON)
    for x in trace:
        a.update(x)
        b.update(x)
    assert [a.forecast(h) for h in range(1, 20)] == [b.forecast(h) for h in range(1, 20)]
    assert a.season == b.season and (a.level, a.trend) == (b.level, b.trend)


def test_before_a_season_it_is_level_and_trend_and_never_negative():
    hw = HoltWinters(SEASON)
    assert hw.forecast(3) == 0.0 and not hw.seasonal
    for x in (1.0, 2.0, 3.0, 4.0):
        hw.update(x)
    assert not hw.seasonal and hw.forecast(1) > 3.0  # a rising trend is carried forward
    falling = HoltWinters(1, alpha=1.0, beta=1.0, phi=1.0)
    for x in (10.0, 5.0, 0.0):
        falling.update(x)
    assert falling.forecast(5) == 0.0  # a rate does not go below zero


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="season_length"):
        HoltWinters(0)
    with pytest.raises(ValueError, match="alpha"):
        HoltWinters(4, alpha=1.5)


class _Clock:
    """A clock the test moves by hand (the forecaster reads time only through it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_are_counted_in_intervals_and_idle_ones_count_as_zero():
    clock = _Clock()
    f = LoadForecaster(ForecastConfig(interval=10, season=0, lead=10), clock=clock)
    f.observe(tokens=100, n=20)
    assert f.last_request_rate == 0.0  # the interval is still open
    clock.now += 10
    f.roll()
    assert (f.last_request_rate, f.last_token_rate) == (2.0, 10.0)
    clock.now += 30  # three idle intervals
    f.roll()
    assert f.last_request_rate == 0.0 and f.requests.samples == 4


def test_desired_replicas_follow_the_forecast_with_the_load_now_as_a_floor():
    clock = _Clock()
    config = ForecastConfig(interval=10, season=0, lead=60, replica_capacity=2.0, min_replicas=1, max_replicas=5)
    f = LoadForecaster(config, clock=clock)
    assert f.desired_replicas() == 1  # nothing seen: the floor
    for rate in (1, 2, 3, 4, 5):  # a ramp of 1 req/s more every interval
        f.observe(n=rate * 10)
        clock.now += 10
    f.roll()
    assert f.last_request_rate == 5.0 and replicas_for(5.0, 2.0) == 3
    assert f.forecast_request_rate() > 5.0  # the ramp goes on up to the lead time
    assert f.desired_replicas() == 4  # ahead of the 3 the load now needs
    assert LoadForecaster(ForecastConfig(), clock=clock).desired_replicas() is None  # no capacity: no answer
    big = LoadForecaster(ForecastConfig(interval=10, season=0, replica_capacity=1.0, max_replicas=5), clock=clock)
    big.observe(n=1000)
    clock.now += 10
    assert big.desired_replicas() == 5  # the ceiling


def test_the_binding_capacity_wins():
    clock = _Clock()
    f = LoadForecaster(ForecastConfig(interval=10, season=0, replica_capacity=10.0, replica_token_capacity=1000.0),
                       clock=clock)
    f.observe(tokens=30_000, n=10)  # 1 req/s but 3000 tokens/s
    clock.now += 10
    assert f.desired_replicas() == 3


def test_requested_tokens_count_the_prompt_and_the_completion_bound():
    assert requested_tokens("x" * 400, {"max_tokens": 50}) == 150
    assert requested_tokens("x" * 400, {"max_completion_tokens": 20, "max_tokens": 50}) == 120
    assert requested_tokens("", "not json") == 0
