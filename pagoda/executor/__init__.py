"""Executors: how the engine core reaches its workers (in-process, processes, Ray)."""

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor
from pagoda.executor.multiproc import MultiprocExecutor
from pagoda.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    """The executor of ``--distributed-executor-backend`` (``config.parallel.backend``)."""
    backend = config.parallel.backend
    if backend == "uni":
        return UniProcExecutor(config)
    if backend == "mp":
        return MultiprocExecutor(config)
    if backend == "ray":
        from pagoda.executor.ray import RayExecutor  # optional: Ray (the ray extra) loads only for this backend

        return RayExecutor(config)
    raise ValueError(f"unknown distributed executor backend {backend!r}")
