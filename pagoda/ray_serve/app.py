"""pagoda as a Ray Serve application: `build_app` (the Python API) and `run` (`pagoda serve
--ray-serve`).

Two deployments (docs/scaling-out.md, "Ray Serve"):

- `pagoda-engine`: the engine replicas (engine_replica.py), autoscaled by Serve
  (autoscaling.py) and routed to by pagoda's policy as a custom request router
  (request_router.py); with tensor parallelism, N bundles a replica, packed on one node;
- `pagoda-ingress`: the OpenAI-compatible endpoint behind Serve's HTTP proxy (ingress.py), one
  light replica that reads each request and calls the engine deployment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from pagoda.engine_args import EngineArgs
from pagoda.ray_serve.autoscaling import ScalingOptions
from pagoda.ray_serve.engine_replica import EngineReplica, ServerOptions
from pagoda.ray_serve.ingress import build_ingress_app
from pagoda.ray_serve.request_router import PagodaRequestRouter

logger = logging.getLogger("pagoda.ray_serve")

APP_NAME = "pagoda"
ENGINE_DEPLOYMENT = "pagoda-engine"
INGRESS_DEPLOYMENT = "pagoda-ingress"


@serve.ingress()
class Ingress:
    """The ingress deployment's class; its ASGI app is built once the handle is known."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __serve_build_asgi_app__(self):
        return build_ingress_app(lambda: self.engine)


def build_app(model: str | EngineArgs, *, scaling: ScalingOptions | None = None, policy: str = "cache_aware",
              server: ServerOptions | None = None, replica_cpus: float = 1.0, ingress_cpus: float = 0.0,
              max_ongoing_requests: int = 32, **engine_kwargs) -> serve.Application:
    """The Serve application of pagoda on `model` (a model name or path with `EngineArgs` fields
    as keyword arguments, or an `EngineArgs`). Run it with `serve.run(app, route_prefix="/")`.

    `replica_cpus` is what Ray reserves for each engine replica (for each rank with tensor
    parallelism); `max_ongoing_requests` is how many requests Serve sends one replica at once
    (the engine queues past --max-num-seqs)."""
    engine_args = model if isinstance(model, EngineArgs) else EngineArgs(model=model, **engine_kwargs)
    scaling = scaling or ScalingOptions()
    scaling.check()
    tp = engine_args.tensor_parallel_size
    if tp > 1:  # ranks 1..N-1 as Ray actors in the replica's own placement group
        engine_args = dataclasses.replace(engine_args, distributed_executor_backend="ray")
    server = server or ServerOptions([engine_args.model])
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        autoscaling_config=scaling.autoscaling_config(),
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus},
        placement_group_bundles=[{"CPU": replica_cpus}] * tp if tp > 1 else None,
        placement_group_strategy="STRICT_PACK" if tp > 1 else None,
        request_router_config=RequestRouterConfig(request_router_class=PagodaRequestRouter,
                                                  request_router_kwargs={"policy": policy}),
        health_check_period_s=5.0,
    )
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=1, ray_actor_options={"num_cpus": ingress_cpus}, max_ongoing_requests=10_000)
    return ingress.bind(engine.bind(engine_args, server))


def serve_on(app: serve.Application, host: str, port: int) -> None:
    """Start Serve's HTTP proxy on host:port (in the cluster this process is connected to) and
    deploy `app` at "/"; returns once the deployments are running."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def connect() -> bool:
    """Join the cluster at RAY_ADDRESS, else start a local one; True when this call started it."""
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address, ignore_reinit_error=True)
    return address is None


def run(ns) -> int:
    """`pagoda serve --ray-serve`: deploy, print the endpoint, wait for SIGINT / SIGTERM, then
    delete the app (and stop the cluster if this command started it)."""
    from pagoda.ray_serve.options import scaling_options, server_options  # argparse-only helpers

    app = build_app(EngineArgs.from_cli_args(ns), scaling=scaling_options(ns), policy=ns.router_policy,
                    server=server_options(ns), replica_cpus=ns.replica_cpus,
                    max_ongoing_requests=ns.max_ongoing_requests)
    started = connect()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve_on(app, ns.host, ns.port)
        print(f"pagoda: serving on http://{ns.host}:{ns.port}/v1 through Ray Serve "
              f"({'a local Ray cluster' if started else 'RAY_ADDRESS=' + os.environ['RAY_ADDRESS']})", flush=True)
        stop.wait()
    finally:
        serve.delete(APP_NAME)
        if started:
            serve.shutdown()
        ray.shutdown()
    print("pagoda: stopped", flush=True)
    return 0
