"""The `pagoda router` command line. Light on purpose: `pagoda --help` builds this parser, so it
imports only argparse; the router itself (Starlette, httpx, uvicorn) loads when it runs."""

from __future__ import annotations

import argparse

from pagoda import envs
from pagoda.router import POLICIES

ADMIN_KEY_ENV = "PAGODA_ROUTER_ADMIN_KEY"


def add_shutdown_timeout_arg(p: argparse.ArgumentParser) -> None:
    """`--shutdown-timeout`, the same for `pagoda serve` and `pagoda router` (both stop by
    pagoda/entrypoints/graceful.py's rules)."""
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM / SIGINT, seconds in-flight requests get to finish before they are aborted "
                        "(a stream ends with a shutting_down error event and [DONE])")


def admin_key(value: str | None, option: str) -> str | None:
    """The admin key from `option` or else the environment; None: the admin routes stay off. An
    empty one is refused: it is almost always an unset shell variable (`--admin-key "$KEY"`), and
    taking it silently left the admin routes off with nothing said."""
    if value is not None and not value.strip():
        raise ValueError(f"{option} is empty (an unset variable?): give the key, or leave {option} out "
                         "to keep the admin routes off")
    return value or envs.PAGODA_ROUTER_ADMIN_KEY


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a `pagoda serve` replica, e.g. http://127.0.0.1:8001 (repeat for each; more can be added "
                        "at run time with POST /workers)")
    p.add_argument("--discover", action="append", default=[], metavar="HOST:PORT",
                   help="workers from DNS: every address HOST resolves to (e.g. a Kubernetes headless Service), "
                        "looked up again each --health-interval; new ones are added and warm up, gone ones removed")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="cache_aware", choices=POLICIES,
                   help="how a request picks its worker (docs/architecture.md, 'The router')")
    p.add_argument("--admin-key", default=None,
                   help="bearer token for GET/POST/DELETE /workers (without it those routes are off; also "
                        "PAGODA_ROUTER_ADMIN_KEY)")
    p.add_argument("--max-requests-in-flight", type=int, default=None,
                   help="requests the router holds at once before it answers 429 (default: no bound)")
    p.add_argument("--qps", type=float, default=None, help="requests a second over all clients (default: no limit)")
    p.add_argument("--qps-per-key", type=float, default=None,
                   help="requests a second per API key (the Authorization bearer token; default: no limit)")
    p.add_argument("--warmup-seconds", type=float, default=30.0,
                   help="a worker that joins or recovers ramps from 10%% to its full share of traffic over this window")
    p.add_argument("--health-interval", type=float, default=5.0,
                   help="seconds between GET /health probes of each worker")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds to wait for the next bytes from a worker before giving up on it (default: no limit)")
    p.add_argument("--breaker-failures", type=int, default=3,
                   help="failures in a row that open a worker's circuit breaker")
    p.add_argument("--breaker-open-seconds", type=float, default=10.0,
                   help="how long an open breaker keeps a worker out before one trial request")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="cache_aware: the part of a prompt a worker must have seen to be chosen for its cache")
    p.add_argument("--balance-abs-threshold", type=int, default=16,
                   help="cache_aware: in-flight difference (max - min) beyond which load wins over cache")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="cache_aware: ... and max in flight above this times min")
    add_shutdown_timeout_arg(p)
    add_forecast_args(p)
    add_pd_args(p)
    add_kv_events_args(p)


def add_kv_events_args(p: argparse.ArgumentParser) -> None:
    """Exact prefix routing on the workers' KV events (pagoda/router/kv_routing.py)."""
    g = p.add_argument_group("exact prefix routing: the workers' KV events (cache_aware)")
    g.add_argument("--kv-events", action="append", default=[], metavar="URL=ENDPOINT",
                   help="where a worker publishes its KV events (its `--kv-events-config` endpoint), e.g. "
                        "http://10.0.0.5:8000=tcp://10.0.0.5:5557; the router subscribes and routes a prompt to the "
                        "worker whose prefix cache holds the most of it (repeat for each worker)")
    g.add_argument("--kv-events-port", type=int, default=None,
                   help="every worker not named by --kv-events publishes on this port of its own host "
                        "(workers added or discovered later too)")
    g.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="the workers' model (a directory, .gguf or catalog name), whose tokenizer and chat template "
                        "turn prompts into the token ids the KV events hold; needed with --kv-events")


def add_pd_args(p: argparse.ArgumentParser) -> None:
    """Prefill / decode disaggregation, SGLang's flags (pagoda/router/disaggregation.py)."""
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--pd-disaggregation", action="store_true",
                   help="send each generation request to a --prefill replica first (the prompt and its first token; "
                        "its KV goes to the shared KV tier), then to a --decode replica, which generates")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a `pagoda serve --kv-role prefill` replica (repeat for each)")
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a `pagoda serve --kv-role decode` replica (repeat for each); they are the router's workers")


def pd_workers(ns: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """(workers, prefill workers or None) of the flags; a ValueError names a missing half."""
    if not ns.pd_disaggregation:
        if ns.prefill or ns.decode:
            raise ValueError("--prefill and --decode take effect with --pd-disaggregation")
        return ns.worker, None
    if not ns.prefill or not (ns.decode or ns.worker):
        raise ValueError("--pd-disaggregation needs at least one --prefill URL and one --decode URL")
    return ns.worker + ns.decode, ns.prefill


def parse_endpoints(specs: list[str]) -> dict[str, str]:
    """`--kv-events URL=ENDPOINT` flags as {worker URL: endpoint}; a ValueError names a bad one."""
    endpoints = {}
    for spec in specs:
        url, sep, endpoint = spec.partition("=")
        if not sep or not url.startswith(("http://", "https://")) or not endpoint.startswith("tcp://"):
            raise ValueError(f"--kv-events {spec!r}: give WORKER_URL=tcp://HOST:PORT, e.g. "
                             "http://10.0.0.5:8000=tcp://10.0.0.5:5557")
        endpoints[url.rstrip("/")] = endpoint
    return endpoints


def add_forecast_args(p: argparse.ArgumentParser) -> None:
    """Predictive autoscaling (pagoda/router/forecast.py): what /metrics publishes as
    pagoda:forecast_request_rate, pagoda:forecast_token_rate and pagoda:desired_replicas."""
    g = p.add_argument_group("predictive autoscaling: the load forecast on /metrics")
    g.add_argument("--forecast-interval", type=float, default=60.0,
                   help="seconds per sample of the request and token rates")
    g.add_argument("--forecast-season", type=float, default=86400.0,
                   help="seconds after which the load repeats (a day; 0: no season, level and trend only)")
    g.add_argument("--forecast-lead", type=float, default=120.0,
                   help="seconds ahead to provision for: a new replica's start-up (pull, kernel build, load) "
                        "plus --warmup-seconds")
    g.add_argument("--replica-capacity", type=float, default=None,
                   help="requests/s one replica serves within its SLOs (e.g. `pagoda tune`'s goodput); with it "
                        "/metrics publishes pagoda:desired_replicas")
    g.add_argument("--replica-token-capacity", type=float, default=None,
                   help="tokens/s one replica serves within its SLOs (prompt + completion); with it too, the "
                        "capacity that binds wins")
    g.add_argument("--min-desired-replicas", type=int, default=1, help="pagoda:desired_replicas' floor")
    g.add_argument("--max-desired-replicas", type=int, default=None, help="pagoda:desired_replicas' ceiling")


def forecast_config(ns: argparse.Namespace):
    """The ForecastConfig of `pagoda router`'s flags."""
    from pagoda.router.forecast import ForecastConfig  # deferred: this module stays argparse only

    return ForecastConfig(interval=ns.forecast_interval, season=ns.forecast_season, lead=ns.forecast_lead,
                          replica_capacity=ns.replica_capacity, replica_token_capacity=ns.replica_token_capacity,
                          min_replicas=ns.min_desired_replicas, max_replicas=ns.max_desired_replicas)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`pagoda serve`'s data-parallel options (pagoda.router.data_parallel)."""
    g = p.add_argument_group("data parallel: several replicas behind the router, in one command")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas to start on this host, each on its share of the cores, behind the router, "
                        "which listens on --host/--port (1: one server, no router)")
    g.add_argument("--data-parallel-rank", type=int, default=None,
                   help="serve as replica RANK of --data-parallel-size, pinned to its share of the cores "
                        "(set by --data-parallel-size for the replicas it starts)")
    g.add_argument("--router-policy", default="cache_aware", choices=POLICIES, help="the router's --policy")
    g.add_argument("--router-admin-key", default=None,
                   help="the router's --admin-key, for GET/POST/DELETE /workers (also PAGODA_ROUTER_ADMIN_KEY)")
    g.add_argument("--router-max-requests-in-flight", type=int, default=None,
                   help="the router's --max-requests-in-flight (default: no bound)")
    g.add_argument("--router-qps", type=float, default=None, help="the router's --qps (default: no limit)")
    g.add_argument("--router-qps-per-key", type=float, default=None,
                   help="the router's --qps-per-key (default: no limit)")
    g.add_argument("--router-warmup-seconds", type=float, default=30.0,
                   help="the router's --warmup-seconds: the ramp of a replica that was restarted")
    g.add_argument("--router-health-interval", type=float, default=5.0, help="the router's --health-interval")
    g.add_argument("--max-replica-restarts", type=int, default=3,
                   help="how many times each replica that exits on its own is started again")


def run(ns: argparse.Namespace) -> int:
    from pagoda.router.config import RouterConfig  # deferred: this module stays argparse only
    from pagoda.router.server import run_router  # deferred: loads httpx, orjson, prometheus_client, starlette, uvicorn

    workers, prefill_workers = pd_workers(ns)
    config = RouterConfig(
        workers=workers, prefill_workers=prefill_workers, discover=ns.discover, policy=ns.policy, admin_key=admin_key(ns.admin_key, "--admin-key"),
        max_requests_in_flight=ns.max_requests_in_flight, qps=ns.qps, qps_per_key=ns.qps_per_key,
        warmup_seconds=ns.warmup_seconds, health_interval=ns.health_interval, request_timeout=ns.request_timeout,
        breaker_failures=ns.breaker_failures, breaker_open_seconds=ns.breaker_open_seconds,
        cache_threshold=ns.cache_threshold, balance_abs_threshold=ns.balance_abs_threshold,
        balance_rel_threshold=ns.balance_rel_threshold, forecast=forecast_config(ns),
        kv_events=parse_endpoints(ns.kv_events), kv_events_port=ns.kv_events_port, tokenizer=ns.tokenizer)
    return run_router(config, ns.host, ns.port, ns.log_level, ns.shutdown_timeout)
