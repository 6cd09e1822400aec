"""Executors: how the engine core reaches its workers (in-process, processes, Ray)."""

from pagoda.executor.base import Executor, make_executor

__all__ = ["Executor", "make_executor"]
