"""One worker, in the engine's process: the default at tensor-parallel size 1."""

from __future__ import annotations

from typing import Any

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor
from pagoda.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.driver_worker = Worker(config)

    def run_on_all(self, method: str, args: tuple, gather: bool) -> Any:
        result = getattr(self.driver_worker, method)(*args)
        return [result] if gather else result
