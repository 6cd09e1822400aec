"""Load forecasting for predictive autoscaling: the router's request and token rates, smoothed by
Holt-Winters (additive, damped trend), and the replicas they will need.

Why a forecast: a new replica takes minutes to be useful (the pod is scheduled, `pagoda pull`
fetches the model, the kernels build, the model loads, the router's warm-up ramp lets it take a
full share). A scaler that reacts to the load it sees now is that late on every ramp. One that acts
on the load expected `lead` seconds ahead has the replica ready when the load arrives.

Why Holt-Winters: LLM traffic is mostly diurnal (people's working hours) with a trend through the
day, and scheduled jobs repeat at the same time of day. Triple exponential smoothing models exactly
level + trend + a repeating season, is a few lines, needs no training step and no dependency, and is
deterministic: the same samples give the same forecast. Each sample `x` (requests or tokens per
second over one interval) updates three numbers and one seasonal slot:

    level  = alpha * (x - season[i])       + (1 - alpha) * (level + phi * trend)
    trend  = beta  * (level - prev_level)  + (1 - beta)  * phi * trend
    season[i] = gamma * (x - level)        + (1 - gamma) * season[i]

and the forecast `h` intervals ahead is `level + (phi + ... + phi^h) * trend + season[i + h]`.
The trend is damped (`phi` < 1) so that a burst's steep rise does not extrapolate without bound.
The first season only fills a buffer: its mean starts the level and its deviations from the
mean start the season; until then the forecast is Holt's level + trend alone. Rates below zero
are forecast as zero. What it cannot do: foresee a burst that has never happened at that time of
day; `desired_replicas` therefore never asks for fewer replicas than the load seen now needs (the
reactive answer is its floor).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass
class HoltWinters:
    """Additive Holt-Winters with a damped trend over evenly spaced samples (see the module's
    docstring for the equations). `season_length` is in samples; 1 means no season."""

    season_length: int
    alpha: float = 0.5  # how fast the level follows the samples
    beta: float = 0.2  # how fast the trend follows the level's changes (a ramp is seen within a few samples)
    gamma: float = 0.3  # how fast a slot of the season follows what was seen at that time
    phi: float = 0.9  # trend damping: a trend's effect h steps ahead sums phi + ... + phi^h
    level: float | None = None
    trend: float = 0.0
    season: list[float] = field(default_factory=list)
    samples: int = 0  # samples seen
    _first: list[float] = field(default_factory=list)  # the first season, until it is complete

    def __post_init__(self) -> None:
        if self.season_length < 1:
            raise ValueError(f"season_length must be >= 1, got {self.season_length}")
        for name in ("alpha", "beta", "gamma", "phi"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)}")

    @property
    def seasonal(self) -> bool:
        """Whether the season is known (one full season seen)."""
        return bool(self.season)

    def update(self, x: float) -> None:
        """One more sample."""
        slot = self.samples % self.season_length
        self.samples += 1
        if not self.season and self.season_length > 1:
            self._first.append(x)
            self._holt(x, 0.0)
            if len(self._first) == self.season_length:
                mean = sum(self._first) / self.season_length
                self.season = [v - mean for v in self._first]
                self.level, self.trend, self._first = mean, 0.0, []
            return
        seasonal = self.season[slot] if self.season else 0.0
        level = self._holt(x, seasonal)
        if self.season:
            self.season[slot] = self.gamma * (x - level) + (1 - self.gamma) * seasonal

    def _holt(self, x: float, seasonal: float) -> float:
        """The level and trend updates; returns the new level."""
        if self.level is None:
            self.level = x - seasonal
            return self.level
        previous = self.level
        self.level = self.alpha * (x - seasonal) + (1 - self.alpha) * (previous + self.phi * self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.phi * self.trend
        return self.level

    def forecast(self, h: int = 1) -> float:
        """The sample expected `h` >= 1 intervals after the last one (0 before any sample)."""
        if self.level is None:
            return 0.0
        damped = sum(self.phi ** k for k in range(1, h + 1))
        seasonal = self.season[(self.samples + h - 1) % self.season_length] if self.season else 0.0
        return max(0.0, self.level + damped * self.trend + seasonal)


@dataclass(frozen=True)
class ForecastConfig:
    """The forecaster's settings (`pagoda router --forecast-*`, `--replica-capacity*`)."""

    interval: float = 60.0  # seconds per sample
    season: float = 86_400.0  # seconds per season (a day); 0: no season
    lead: float = 120.0  # seconds ahead to provision for: a new replica's start-up and warm-up
    replica_capacity: float | None = None  # requests/s one replica serves within its SLOs
    replica_token_capacity: float | None = None  # tokens/s one replica serves within its SLOs
    min_replicas: int = 1
    max_replicas: int | None = None

    @property
    def season_length(self) -> int:
        return max(1, round(self.season / self.interval)) if self.season > 0 else 1

    @property
    def horizon(self) -> int:
        """The lead time in samples (at least one)."""
        return max(1, math.ceil(self.lead / self.interval))


class LoadForecaster:
    """The request and token rates in fixed intervals, their forecasts, and the replicas needed.

    Requests are counted as they arrive (`observe`); an interval is closed and fed to the
    smoothers when the clock passes its end, at the next `observe` or read (`roll`), so nothing
    runs in the background and an idle interval counts as a zero rate."""

    def __init__(self, config: ForecastConfig, clock: Clock = time.monotonic) -> None:
        if config.interval <= 0:
            raise ValueError(f"the forecast interval must be > 0, got {config.interval}")
        self.config, self.clock = config, clock
        self.requests = HoltWinters(config.season_length)
        self.tokens = HoltWinters(config.season_length)
        self._start = clock()
        self._count, self._token_count = 0, 0.0
        self.last_request_rate, self.last_token_rate = 0.0, 0.0  # of the last closed interval

    def observe(self, tokens: float = 0.0, n: int = 1) -> None:
        """`n` requests arrived now, asking for `tokens` tokens (prompt + completion) in all."""
        self.roll()
        self._count += n
        self._token_count += tokens

    def roll(self) -> None:
        """Close every interval that has ended (the ones with no requests as zeros)."""
        interval = self.config.interval
        now = self.clock()
        while now - self._start >= interval:
            self.last_request_rate, self.last_token_rate = self._count / interval, self._token_count / interval
            self.requests.update(self.last_request_rate)
            self.tokens.update(self.last_token_rate)
            self._count, self._token_count = 0, 0.0
            self._start += interval

    def forecast_request_rate(self) -> float:
        """Requests/s expected at the lead time: the highest forecast up to it."""
        self.roll()
        return max(self.requests.forecast(h) for h in range(1, self.config.horizon + 1))

    def forecast_token_rate(self) -> float:
        self.roll()
        return max(self.tokens.forecast(h) for h in range(1, self.config.horizon + 1))

    def desired_replicas(self) -> int | None:
        """Replicas for the larger of the load seen now and the load forecast up to the lead time,
        by whichever capacity binds; None when no capacity is configured."""
        c = self.config
        if c.replica_capacity is None and c.replica_token_capacity is None:
            return None
        self.roll()
        needed = c.min_replicas
        for rate, forecast, capacity in (
                (self.last_request_rate, self.forecast_request_rate(), c.replica_capacity),
                (self.last_token_rate, self.forecast_token_rate(), c.replica_token_capacity)):
            if capacity:
                needed = max(needed, replicas_for(max(rate, forecast), capacity))
        return needed if c.max_replicas is None else min(needed, c.max_replicas)


def replicas_for(rate: float, capacity: float) -> int:
    """Replicas that serve `rate` at `capacity` each (a hair under a whole one rounds down, so that
    float noise in a rate does not add a replica)."""
    return max(0, math.ceil(rate / capacity - 1e-9))


def requested_tokens(prompt_text: str, body: object) -> float:
    """A request's tokens as the router can tell them without a tokenizer: the prompt at ~4
    characters a token, plus the completion's bound (`max_tokens` / `max_completion_tokens`)."""
    tokens = len(prompt_text) / 4
    if isinstance(body, dict):
        bound = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(bound, int) and bound > 0:
            tokens += bound
    return tokens


__all__ = ["ForecastConfig", "HoltWinters", "LoadForecaster", "replicas_for", "requested_tokens"]
