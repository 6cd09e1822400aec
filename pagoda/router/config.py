"""What `pagoda router` is told: its workers and how it picks among them (the flags, options.py),
as one object the router, `pagoda serve --data-parallel-size` and the tests build."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.router.forecast import ForecastConfig


@dataclass
class RouterConfig:
    workers: list[str] = field(default_factory=list)
    discover: list[str] = field(default_factory=list)  # HOST:PORT names whose addresses are workers (discovery.py)
    policy: str = "cache_aware"
    admin_key: str | None = None
    max_requests_in_flight: int | None = None
    qps: float | None = None
    qps_per_key: float | None = None
    warmup_seconds: float = 30.0
    health_interval: float = 5.0
    connect_timeout: float = 5.0
    request_timeout: float | None = None  # seconds between bytes from a worker; None: no limit
    breaker_failures: int = 3
    breaker_open_seconds: float = 10.0
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    forecast: ForecastConfig = field(default_factory=ForecastConfig)  # predictive autoscaling (forecast.py)
    # --pd-disaggregation: generation requests are prefilled on these first (disaggregation.py); the
    # decode replicas are `workers`
    prefill_workers: list[str] | None = None
    # exact prefix routing on the workers' KV events (kv_routing.py): worker URL -> its publisher's endpoint,
    # the port every other worker publishes on, and the workers' model (its tokenizer)
    kv_events: dict[str, str] = field(default_factory=dict)
    kv_events_port: int | None = None
    tokenizer: str | None = None
