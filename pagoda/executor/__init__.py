"""Executors: how the engine core reaches its workers (in-process, processes, Ray)."""

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor
from pagoda.executor.multiproc import MultiprocExecutor
from pagoda.executor.ray import RayExecutor
from pagoda.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "make_executor"]

_EXECUTORS: dict[str, type[Executor]] = {"uni": UniProcExecutor, "mp": MultiprocExecutor, "ray": RayExecutor}


def make_executor(config: EngineConfig) -> Executor:
    """The executor of ``--distributed-executor-backend`` (``config.parallel.backend``)."""
    backend = config.parallel.backend
    if backend not in _EXECUTORS:
        raise ValueError(f"unknown distributed executor backend {backend!r}")
    return _EXECUTORS[backend](config)
