"""The router's probes of a replica whose model loads layer by layer: its /health answers come
from the replica's own ``loading_health`` (pagoda/entrypoints/openai/loading.py), served through
an ASGI transport. Under ``--ready-when loaded`` the replica is down, with its progress as the
reason; under ``serving`` it is up but its warm-up ramp stays at the floor until it has loaded."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from fakes import FakeClock
from pagoda.entrypoints.openai.loading import loading_health
from pagoda.router.workers import MIN_WEIGHT, WorkerRegistry

URL = "http://replica:8000"


def _replica(state: dict, ready_when: str) -> httpx.AsyncClient:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return loading_health(state["progress"], ready_when)

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app))


def _progress(layers_loaded: int | None) -> dict | None:
    """The engine's loading state: ``layers_loaded`` of 16, None once loaded whole or done."""
    if layers_loaded is None:
        return None
    return {"loading": layers_loaded < 16, "layers_loaded": layers_loaded, "num_layers": 16, "outer_loaded": True,
            "seconds": 1.0, "error": None}


def _setup(layers_loaded: int, ready_when: str):
    """A fake clock, the replica's loading state (changed by the test), a registry of that replica
    and a client that reaches it."""
    clock, state = FakeClock(), {"progress": _progress(layers_loaded)}
    registry = WorkerRegistry(warmup_seconds=30, clock=clock)
    registry.add(URL)
    return clock, state, registry, _replica(state, ready_when)


def _probe(registry: WorkerRegistry, client: httpx.AsyncClient):
    worker = registry.get(URL)
    asyncio.run(registry.probe(worker, client))
    return worker


def test_a_loading_replica_is_down_with_its_progress_until_loaded():
    _, state, registry, client = _setup(5, "loaded")
    worker = _probe(registry, client)
    assert not worker.healthy and worker.down_reason == "loading its model (5/16 layers in place)"
    assert worker.describe()["loading"] == "5/16"
    state["progress"] = _progress(16)
    worker = _probe(registry, client)
    assert worker.healthy and worker.weight() == MIN_WEIGHT and worker.loading is None


def test_a_replica_serving_while_loading_stays_at_the_start_of_its_ramp():
    clock, state, registry, client = _setup(3, "serving")
    worker = _probe(registry, client)
    assert worker.healthy and worker.weight() == MIN_WEIGHT  # takes a trickle of requests
    clock.advance(30)
    worker = _probe(registry, client)  # still loading: the ramp has not started
    assert worker.weight() == MIN_WEIGHT
    state["progress"] = None
    clock.advance(15)
    worker = _probe(registry, client)  # loaded: the ramp runs from the last loading probe
    assert worker.weight() == 0.5
