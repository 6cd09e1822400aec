"""Progress lines for the slow first-start steps (kernel build, dtype measurement), so a start
that takes a minute never looks hung."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger("pagoda")


@contextlib.contextmanager
def progress(message: str, every: float = 15.0) -> Iterator[None]:
    """Log ``message`` with the elapsed time every ``every`` seconds until the block ends."""
    done, start = threading.Event(), time.monotonic()

    def tick() -> None:
        while not done.wait(every):
            logger.warning("%s (%.0fs)...", message, time.monotonic() - start)

    thread = threading.Thread(target=tick, name="pagoda-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
