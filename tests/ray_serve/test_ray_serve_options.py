"""`pagoda serve --ray-serve`'s flags (pagoda/ray_serve/options.py): what they make of Serve's
autoscaling config, and the combinations refused before anything starts."""

from __future__ import annotations

import pytest

from pagoda.cli import build_parser
from pagoda.ray_serve.options import check_args, scaling_options


def _serve(*argv: str):
    return build_parser().parse_args(["serve", "--ray-serve", *argv])


def test_flags_become_serves_autoscaling_config():
    ns = _serve("--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "3",
                "--upscale-delay-s", "5", "--downscale-delay-s", "60")
    config = scaling_options(ns).autoscaling_config()
    assert config["min_replicas"] == config["initial_replicas"] == 1 and config["max_replicas"] == 4
    assert config["target_ongoing_requests"] == 3 and config["upscale_delay_s"] == 5
    assert config["downscale_delay_s"] == 60 and "policy" not in config


def test_predictive_autoscaling_names_the_forecast_policy():
    from ray.serve.config import AutoscalingConfig

    from pagoda.ray_serve.autoscaling import ForecastPolicy

    ns = _serve("--max-replicas", "3", "--predictive-autoscaling", "--forecast-interval", "5", "--forecast-lead", "30")
    config = AutoscalingConfig(**scaling_options(ns).autoscaling_config())  # Serve accepts it
    assert config.policy.policy_function == f"{ForecastPolicy.__module__}.{ForecastPolicy.__name__}"  # Serve imports it
    assert config.policy.policy_kwargs["interval_s"] == 5 and config.policy.policy_kwargs["lead_s"] == 30


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "2"], "not --data-parallel-size"),
    (["--min-replicas", "3", "--max-replicas", "2"], "is above --max-replicas"),
    (["--model", "a", "--model", "b"], "serves one model"),
])
def test_refused_combinations(argv, message):
    with pytest.raises(ValueError, match=message):
        check_args(_serve(*argv))
