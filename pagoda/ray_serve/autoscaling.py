"""Ray Serve autoscaling for the engine replicas: Serve's own policy from pagoda's flags, or,
with `--predictive-autoscaling`, a custom policy fed by pagoda's load forecaster.

Serve's default policy scales to `ongoing requests / --target-ongoing-requests` replicas, as it
sees them (averaged over `look_back_period_s`). The predictive policy (`ForecastPolicy`, Ray
Serve >= 2.51's class-callable `AutoscalingPolicy`, kept in the Serve controller between calls)
samples the same signal, the deployment's ongoing requests, once a controller tick, averages it
over `interval_s`, smooths the averages with pagoda's Holt-Winters (pagoda/router/forecast.py)
and asks for the replicas that the larger of the load now and the load forecast up to `lead_s`
ahead needs. Serve applies min/max and the up/down delays after it, as for its own policy.
The forecast is of ongoing requests (by Little's law, arrivals times latency), not of the
router's request and token rates: that is the signal Serve gives a policy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from pagoda.router.forecast import HoltWinters, replicas_for


@dataclass(frozen=True)
class ScalingOptions:
    """The engine deployment's autoscaling (`--min-replicas` ... `--downscale-delay-s`)."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0  # the window Serve averages the ongoing requests over
    predictive: bool = False  # the forecast policy instead of Serve's
    forecast_interval_s: float = 10.0
    forecast_lead_s: float = 60.0
    forecast_season_s: float = 0.0  # 0: no season (a day is 86400)

    def check(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got "
                             f"{self.min_replicas} and {self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("--upscale-delay-s and --downscale-delay-s must be >= 0")

    def autoscaling_config(self) -> dict[str, Any]:
        """Serve's `autoscaling_config` of the engine deployment."""
        config: dict[str, Any] = {
            "min_replicas": self.min_replicas, "initial_replicas": self.min_replicas,
            "max_replicas": self.max_replicas, "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
        }
        if self.predictive:
            from ray.serve.config import AutoscalingPolicy  # deferred: loads ray (this module must not need it)

            config["policy"] = AutoscalingPolicy(policy_function=ForecastPolicy, policy_kwargs={
                "target_ongoing_requests": self.target_ongoing_requests, "interval_s": self.forecast_interval_s,
                "lead_s": self.forecast_lead_s, "season_s": self.forecast_season_s})
        return config


class ForecastPolicy:
    """Serve's policy callable: `(AutoscalingContext) -> (replicas, policy state)`."""

    def __init__(self, target_ongoing_requests: float, interval_s: float = 10.0, lead_s: float = 60.0,
                 season_s: float = 0.0, clock=time.monotonic) -> None:
        self.target, self.interval, self.clock = target_ongoing_requests, interval_s, clock
        self.horizon = max(1, math.ceil(lead_s / interval_s))
        self.smoother = HoltWinters(max(1, round(season_s / interval_s)) if season_s > 0 else 1)
        self._start: float | None = None
        self._sum, self._n = 0.0, 0

    def observe(self, ongoing: float) -> None:
        """One sample of the ongoing requests; closes the intervals that have ended (an interval
        with no sample, the controller busy, repeats the last mean)."""
        now = self.clock()
        if self._start is None:
            self._start = now
        while now - self._start >= self.interval:
            mean = self._sum / self._n if self._n else ongoing
            self.smoother.update(mean)
            self._sum, self._n = 0.0, 0
            self._start += self.interval
        self._sum += ongoing
        self._n += 1

    def desired(self, ongoing: float) -> int:
        forecast = max(self.smoother.forecast(h) for h in range(1, self.horizon + 1))
        return replicas_for(max(ongoing, forecast), self.target)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        ongoing = float(ctx.total_num_requests)
        self.observe(ongoing)
        state = dict(ctx.policy_state)
        state["pagoda_forecast"] = max(self.smoother.forecast(h) for h in range(1, self.horizon + 1))
        return self.desired(ongoing), state
