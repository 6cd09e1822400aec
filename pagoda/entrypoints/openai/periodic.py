"""A callback the server runs every so often on its event loop, from app start to app stop:
the sweeps that expire idle sessions and let idle stored responses' pinned prefixes go."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Periodic:
    def __init__(self, interval: float, callback: Callable[[], None]) -> None:
        self.interval, self.callback = interval, callback
        self._task: asyncio.Task | None = None

    @classmethod
    def sweep(cls, ttl: float, callback: Callable[[], None]) -> "Periodic":
        """A sweep for things that expire after `ttl` idle seconds: a few times per ttl, at least
        every 30 s."""
        return cls(max(0.05, min(ttl / 4, 30.0)), callback)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.callback()
