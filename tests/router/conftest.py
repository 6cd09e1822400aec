"""The router tests' shared fixtures: two replicas of the tiny model and a router in front of
them (the processes: router_processes.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from router_processes import LONG_CONTEXT, RouterProcess, start_replicas, stop


@pytest.fixture(scope="session")
def replicas(long_tiny_llama) -> Iterator[list[str]]:
    """Two replicas of the tiny Llama, shared by the router tests that do not kill them."""
    started = start_replicas(long_tiny_llama, 2, *LONG_CONTEXT)
    yield [base for _, base in started]
    for proc, _ in started:
        stop(proc)


@pytest.fixture(scope="module")
def router(replicas) -> Iterator[RouterProcess]:
    """A cache_aware router (the default policy) in front of the shared replicas."""
    r = RouterProcess(replicas)
    yield r
    r.stop()
