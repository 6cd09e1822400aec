"""The router's Prometheus metrics (`GET /metrics`), in a registry of its own, so that several
routers (or a router beside a server, in one test process) do not share counters."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pagoda.router.forecast import LoadForecaster
from pagoda.router.kv_index import KVBlockIndex
from pagoda.router.workers import BreakerState, Worker

PREFIX_MATCH_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384)
BREAKER_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class _WorkerCollector:
    """Per-worker gauges read at scrape time, so a removed worker simply stops appearing."""

    def __init__(self, workers: Callable[[], Iterable[Worker]]) -> None:
        self.workers = workers

    def collect(self):
        gauges = [
            ("pagoda_router:worker_healthy", "1 while the worker's health probes pass.", lambda w: float(w.healthy)),
            ("pagoda_router:worker_available", "1 while the worker takes requests (healthy, breaker not open).",
             lambda w: float(w.available)),
            ("pagoda_router:worker_in_flight", "Requests sent to the worker and not yet finished.",
             lambda w: float(w.in_flight)),
            ("pagoda_router:worker_weight", "Share of traffic during warm-up (0-1).", lambda w: w.weight()),
            ("pagoda_router:worker_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
             lambda w: float(BREAKER_VALUES[w.breaker.state])),
        ]
        workers = list(self.workers())
        for name, doc, read in gauges:
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            for w in workers:
                family.add_metric([w.url], read(w))
            yield family


class _KVIndexCollector:
    """What the router knows of the workers' prefix caches from their KV events (kv_index.py)."""

    def __init__(self, index: KVBlockIndex) -> None:
        self.index = index

    def collect(self):
        family = GaugeMetricFamily("pagoda_router:kv_index_blocks", "Blocks of each worker's prefix cache the "
                                   "router knows of from its KV events.", labels=["worker"])
        for url in list(self.index.workers):
            family.add_metric([url], float(self.index.blocks(url)))
        yield family
        yield GaugeMetricFamily("pagoda_router:kv_index_resets", "Times a worker's blocks were forgotten: a gap "
                                "in its events' sequence numbers, or a restart.", value=float(self.index.resets))


class _ForecastCollector:
    """The load forecast and the replicas it needs, read at scrape time, for an HPA (through
    prometheus-adapter), a KEDA ScaledObject or a Ray Serve policy to scale ahead of a ramp
    (docs/kubernetes.md). The names are the `pagoda:` ones the issue set, not `pagoda_router:`:
    they are the fleet's numbers, not the router's own."""

    def __init__(self, forecaster: LoadForecaster) -> None:
        self.forecaster = forecaster

    def collect(self):
        f = self.forecaster
        f.roll()
        gauges = [
            ("pagoda:request_rate", "Requests/s the router received in the last closed forecast interval.",
             f.last_request_rate),
            ("pagoda:token_rate", "Tokens/s requested in the last closed interval (prompt chars / 4 + max_tokens).",
             f.last_token_rate),
            ("pagoda:forecast_request_rate", "Requests/s forecast (Holt-Winters) up to the lead time, the highest.",
             f.forecast_request_rate()),
            ("pagoda:forecast_token_rate", "Tokens/s forecast (Holt-Winters) up to the lead time, the highest.",
             f.forecast_token_rate()),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        desired = f.desired_replicas()
        if desired is not None:  # only with --replica-capacity / --replica-token-capacity
            yield GaugeMetricFamily("pagoda:desired_replicas", "Replicas for the larger of the load now and the "
                                    "forecast up to the lead time, at the configured capacity per replica.",
                                    value=float(desired))


class RouterMetrics:
    def __init__(self, workers: Callable[[], Iterable[Worker]], forecaster: LoadForecaster,
                 kv_index: KVBlockIndex | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagoda_router:requests", "Requests sent to a worker (retries included).",
                                ["worker"], registry=r)
        self.errors = Counter("pagoda_router:worker_errors",
                              "Requests a worker did not answer: connect, timeout, status (502/503/504), stream "
                              "(broken after it started).", ["worker", "kind"], registry=r)
        self.decisions = Counter("pagoda_router:routing_decisions",
                                 "Routing decisions by reason: session (explicit key on the ring), hash (derived "
                                 "key on the ring), kv_prefix (the worker's KV events hold the prompt's start), "
                                 "prefix (prefix-tree hit), load, round_robin.",
                                 ["reason"], registry=r)
        self.prefix_match = Histogram("pagoda_router:prefix_match_chars",
                                      "cache_aware: characters of the prompt matched in the chosen worker's tree.",
                                      buckets=PREFIX_MATCH_BUCKETS, registry=r)
        self.kv_prefix_match = Histogram("pagoda_router:kv_prefix_match_tokens",
                                         "cache_aware with KV events: prompt tokens the chosen worker's cache holds.",
                                         buckets=PREFIX_MATCH_BUCKETS, registry=r)
        self.retries = Counter("pagoda_router:retries", "Requests retried on another worker.", registry=r)
        self.rejected = Counter("pagoda_router:rate_limited", "Requests answered 429, by limit: the router's own (in_flight, key_qps, global_qps) or a "
                                "worker's (engine: its --max-num-seqs + --max-queue-len were full).",
                                ["level"], registry=r)
        r.register(_WorkerCollector(workers))
        r.register(_ForecastCollector(forecaster))
        if kv_index is not None:
            r.register(_KVIndexCollector(kv_index))

    def render(self) -> bytes:
        return generate_latest(self.registry)
