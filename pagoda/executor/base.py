"""The executor contract: the engine core calls workers by method name; rank 0 answers.

Every executor keeps rank 0 (the driver worker) in the engine's own process, beside the
scheduler, and runs each call on every rank: ``collective_rpc`` returns the driver's result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.outputs import ModelRunnerOutput
from pagoda.worker.worker import Worker


class EngineDeadError(RuntimeError):
    """A worker died or a collective timed out: the engine cannot go on."""


class Executor(ABC):
    driver_worker: Worker

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> Any:
        """Run ``Worker.<method>(*args)`` on every rank; the driver's result."""

    def determine_num_blocks(self) -> int:
        return self.collective_rpc("determine_num_blocks")

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.collective_rpc("initialize_cache", num_blocks, max_model_len)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", sched)

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a worker is gone."""

    def shutdown(self) -> None:
        self.driver_worker.shutdown()


def make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.backend
    if backend == "uni":
        from pagoda.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    if backend == "mp":
        from pagoda.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from pagoda.executor.ray import RayExecutor

        return RayExecutor(config)
    raise ValueError(f"unknown distributed executor backend {backend!r}")
