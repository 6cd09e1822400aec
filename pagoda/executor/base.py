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


class WorkerFailedError(RuntimeError):
    """A worker died or a collective timed out: the engine cannot go on."""


class Executor(ABC):
    driver_worker: Worker

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def run_on_all(self, method: str, args: tuple, gather: bool) -> Any:
        """Run ``Worker.<method>(*args)`` on every rank. ``gather``: every rank's result, in rank
        order; otherwise only the driver's (a step's output comes from rank 0 alone)."""

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """``Worker.<method>(*args)`` on every rank; their results in rank order."""
        return self.run_on_all(method, args, gather=True)

    def driver_rpc(self, method: str, *args: Any) -> Any:
        """``Worker.<method>(*args)`` on every rank; the driver's result."""
        return self.run_on_all(method, args, gather=False)

    def determine_num_blocks(self) -> int:
        return self.driver_rpc("determine_num_blocks")

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.driver_rpc("initialize_cache", num_blocks, max_model_len)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_rpc("execute_model", sched)

    def check_health(self) -> None:
        """Raise ``WorkerFailedError`` if a worker is gone."""

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
