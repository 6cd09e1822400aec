"""The predictive policy (pagoda/ray_serve/autoscaling.py) as Serve's controller calls it, with
Serve's own AutoscalingContext: on a ramp of ongoing requests it asks for the replicas the load
will need `lead_s` ahead, before the load seen now needs them; at rest it asks for what the
load needs (Serve bounds the answer by min/max and the delays after the policy)."""

from __future__ import annotations

from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from pagoda.ray_serve.autoscaling import ForecastPolicy, ScalingOptions
from pagoda.router.forecast import replicas_for


class Clock:
    """Time that the test moves (the policy's samples close on it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _context(ongoing: float, replicas: int, state: dict, config: AutoscalingConfig) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=DeploymentID(name="pagoda-engine", app_name="pagoda"), deployment_name="pagoda-engine",
        app_name="pagoda", current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=[],
        total_num_requests=ongoing, total_queued_requests=0.0, aggregated_metrics={}, raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state, last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=config)


def test_a_ramp_is_provisioned_ahead_of_the_load_seen():
    clock = Clock()
    policy = ForecastPolicy(target_ongoing_requests=2, interval_s=10, lead_s=60, clock=clock)
    config = AutoscalingConfig(min_replicas=1, max_replicas=100, target_ongoing_requests=2)
    ahead = []
    for step in range(12):  # ongoing requests rising by 2 every 10 s, sampled each second
        for _ in range(10):
            ongoing = 2.0 * step
            wanted, state = policy(_context(ongoing, 1, {}, config))
            clock.now += 1.0
        ahead.append(wanted - replicas_for(ongoing, 2))
    assert all(extra >= 0 for extra in ahead)  # never fewer than the load seen needs
    assert ahead[-1] >= 2  # and, once the trend is seen, more: the load a minute ahead
    assert state["pagoda_forecast"] > ongoing


def test_steady_it_asks_for_what_the_load_needs_and_idle_for_at_most_one():
    clock = Clock()
    options = ScalingOptions(min_replicas=1, max_replicas=3, target_ongoing_requests=2)
    config = AutoscalingConfig(**{k: v for k, v in options.autoscaling_config().items() if k != "policy"})
    policy = ForecastPolicy(target_ongoing_requests=2, interval_s=10, clock=clock)
    for _ in range(100):
        wanted, _ = policy(_context(5.0, 1, {}, config))  # a steady 5 ongoing: 3 replicas
        clock.now += 1.0
    assert wanted == 3
    for _ in range(300):  # idle long enough for the smoothed load to decay
        wanted, _ = policy(_context(0.0, 3, {}, config))
        clock.now += 1.0
    assert wanted <= 1  # the smoothed load decays toward zero (Serve keeps min_replicas)
