"""`pagoda serve --ray-serve`'s options. Light on purpose: `pagoda --help` builds this parser, so
it imports only argparse and the option dataclasses; Ray loads when the command runs."""

from __future__ import annotations

import argparse

from pagoda.entrypoints import served_models  # argparse only
from pagoda.ray_serve.autoscaling import ScalingOptions


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve: engine replicas as Serve deployments, autoscaled by Serve "
                             "(docs/scaling-out.md, 'Ray Serve')")
    g.add_argument("--ray-serve", action="store_true",
                   help="deploy on the Ray cluster at RAY_ADDRESS (else a local one started here): engine replicas "
                        "behind Serve's HTTP proxy on --host/--port, routed by --router-policy")
    g.add_argument("--min-replicas", type=int, default=1, help="engine replicas Serve keeps at least")
    g.add_argument("--max-replicas", type=int, default=1, help="engine replicas Serve scales up to")
    g.add_argument("--target-ongoing-requests", type=float, default=2.0,
                   help="requests in flight per replica that Serve's autoscaler aims at")
    g.add_argument("--upscale-delay-s", type=float, default=30.0,
                   help="seconds the load must ask for more replicas before Serve adds them")
    g.add_argument("--downscale-delay-s", type=float, default=600.0,
                   help="seconds the load must ask for fewer replicas before Serve removes them")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves for each engine replica (each tensor-parallel rank), fractions allowed")
    g.add_argument("--max-ongoing-requests", type=int, default=32,
                   help="requests Serve sends one replica at once (the rest wait in Serve's router)")
    g.add_argument("--predictive-autoscaling", action="store_true",
                   help="scale on pagoda's Holt-Winters forecast of the ongoing requests, --forecast-lead seconds "
                        "ahead, instead of on the load seen now (pagoda/ray_serve/autoscaling.py)")
    g.add_argument("--forecast-interval", type=float, default=60.0,
                   help="with --predictive-autoscaling: seconds per sample of the forecast")
    g.add_argument("--forecast-lead", type=float, default=120.0,
                   help="with --predictive-autoscaling: seconds ahead to provision for (a replica's start-up)")
    g.add_argument("--forecast-season", type=float, default=86400.0,
                   help="with --predictive-autoscaling: seconds per season (0: none)")


def scaling_options(ns: argparse.Namespace) -> ScalingOptions:
    return ScalingOptions(min_replicas=ns.min_replicas, max_replicas=ns.max_replicas,
                          target_ongoing_requests=ns.target_ongoing_requests, upscale_delay_s=ns.upscale_delay_s,
                          downscale_delay_s=ns.downscale_delay_s, predictive=ns.predictive_autoscaling,
                          forecast_interval_s=ns.forecast_interval, forecast_lead_s=ns.forecast_lead,
                          forecast_season_s=ns.forecast_season)


def server_options(ns: argparse.Namespace):
    """The replicas' ServerOptions from serve's options."""
    from pagoda.ray_serve.engine_replica import ServerOptions  # deferred: loads ray and the server

    return ServerOptions(ns.served_model_name or [ns.model], api_key=ns.api_key, max_queue_len=ns.max_queue_len,
                         request_timeout=ns.request_timeout, web_ui=not ns.no_web_ui,
                         reasoning_parser=ns.reasoning_parser, tool_call_parser=ns.tool_call_parser)


def check_args(ns: argparse.Namespace) -> None:
    """What --ray-serve cannot be combined with, said before anything starts."""
    if ns.data_parallel_size != 1 or ns.data_parallel_rank is not None:
        raise ValueError("--ray-serve scales with --min-replicas / --max-replicas, not --data-parallel-size")
    if served_models.serves_several(ns):
        raise ValueError("--ray-serve serves one model: give one --model")
    if ns.min_replicas > ns.max_replicas:
        raise ValueError(f"--min-replicas ({ns.min_replicas}) is above --max-replicas ({ns.max_replicas})")
