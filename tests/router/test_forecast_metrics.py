"""The real `pagoda router` publishes the load forecast on /metrics (pagoda/router/forecast.py):
requests through it show up as pagoda:request_rate, its forecast and pagoda:desired_replicas,
the names the HPA (prometheus-adapter) and KEDA manifests in deploy/kubernetes/ query."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagoda.router.forecast import replicas_for
from router_processes import RouterProcess, wait_for

FORECAST_GAUGES = ("pagoda:request_rate", "pagoda:token_rate", "pagoda:forecast_request_rate",
                   "pagoda:forecast_token_rate", "pagoda:desired_replicas")


def _gauges(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in FORECAST_GAUGES}


def test_the_router_publishes_the_forecast_and_the_replicas_it_needs(replicas):
    router = RouterProcess(replicas, "--forecast-interval", "2", "--forecast-season", "0", "--forecast-lead", "4",
                           "--replica-capacity", "0.5", "--max-desired-replicas", "8")
    try:
        idle = _gauges(router.base)
        assert set(idle) == set(FORECAST_GAUGES)
        assert idle["pagoda:desired_replicas"] == 1.0 and idle["pagoda:forecast_request_rate"] == 0.0
        for i in range(4):
            body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 2, "temperature": 0}
            assert httpx.post(f"{router.base}/v1/completions", json=body, timeout=60).status_code == 200
        busy = wait_for(lambda: (g := _gauges(router.base))["pagoda:request_rate"] > 0 and g,
                        timeout=30, interval=0.05, what="an interval with the requests in it")
        assert busy["pagoda:token_rate"] > busy["pagoda:request_rate"]  # each asked for 2 tokens and a prompt
        assert busy["pagoda:forecast_request_rate"] > 0
        # at least what the rate seen needs at 0.5 req/s a replica, under the ceiling
        assert replicas_for(busy["pagoda:request_rate"], 0.5) <= busy["pagoda:desired_replicas"] <= 8
    finally:
        router.stop()
