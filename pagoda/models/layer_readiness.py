"""What is in place of a model the loader fills one decoder layer at a time (loader/progressive_load.py).

The loader's thread marks the outer weights (embedding, final norm, output head) and then each
layer ready once it is fully prepared (copied, quantized, packed); a forward pass waits, at each
layer, for that layer's mark, so a request that arrives while the model loads computes each layer
as it arrives. Once every part is in place the loader sets ``model.loading`` to None: a step then
checks nothing. The waits are ``threading.Event``s: a set event costs one attribute read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

from torch import nn


class LoadFailed(RuntimeError):
    """The loader's thread failed: a forward pass waiting for a layer cannot go on."""


class LayerReadiness:
    def __init__(self, num_layers: int, expected_bytes: int = 0, stage_shares: list[float] | None = None) -> None:
        """``expected_bytes``: the model's size once loaded, known beforehand (file bytes, parameter
        shapes); ``stage_shares``: each stage's part of it (the outer weights, then each layer)."""
        self.num_layers = num_layers
        self.expected_bytes = expected_bytes
        self.stage_shares = stage_shares or [1.0 / (num_layers + 1)] * (num_layers + 1)
        self.started = time.monotonic()
        self.finished: float | None = None  # when the last part was marked ready
        self.error: BaseException | None = None
        self.cancelled = False
        self._outer = threading.Event()
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._loaded_layers = 0
        self._lock = threading.Lock()
        self._when_loaded: list[Callable[[], None]] = []
        self._over = threading.Event()  # finished or failed
        self._when_failed: list[Callable[[BaseException], None]] = []

    # -- the loader's side -------------------------------------------------------------------
    def mark_outer(self) -> None:
        self._outer.set()

    def mark_layer(self, index: int) -> None:
        self._loaded_layers = index + 1  # the loader marks layers in order
        self._layers[index].set()

    def finish(self) -> None:
        """Every part is in place: run what waited for it (the model runner's choice of the fused
        decode stack), on the loader's thread, before the model stops checking."""
        with self._lock:
            self.finished = time.monotonic()
            callbacks, self._when_loaded = self._when_loaded, []
        for callback in callbacks:
            callback()
        self._over.set()

    def cancel(self) -> None:
        """Stop the loader at its next stage (the engine shuts down while the model loads)."""
        self.cancelled = True

    def fail(self, error: BaseException) -> None:
        """Wake every waiter: each raises ``LoadFailed``."""
        self.error = error
        self._outer.set()
        for event in self._layers:
            event.set()
        self._over.set()
        if not self.cancelled:  # (a shutdown's own stop is no failure to report)
            for callback in self._when_failed:
                callback(error)

    def when_failed(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback`` with the error if the load fails (the engine then counts as dead)."""
        self._when_failed.append(callback)
        if self.error is not None and not self.cancelled:
            callback(self.error)

    # -- the engine's side -------------------------------------------------------------------
    def when_loaded(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once every part is in place (at once if it already is)."""
        with self._lock:
            if self.finished is None:
                self._when_loaded.append(callback)
                return
        callback()

    def wait_loaded(self) -> None:
        """Until every part is in place and what waited for that has run (LoadFailed if the load failed)."""
        self._wait(self._over)

    def wait_outer(self) -> None:
        self._wait(self._outer)

    def as_ready(self, layers: Iterable[nn.Module]) -> Iterator[nn.Module]:
        """The layers in order, each once it is in place."""
        for event, layer in zip(self._layers, layers):
            self._wait(event)
            yield layer

    def _wait(self, event: threading.Event) -> None:
        event.wait()
        if self.error is not None:
            raise LoadFailed(f"loading the model failed: {self.error}") from self.error

    def pending_bytes(self) -> int:
        """What the parts not yet in place will take: memory sizing (the KV cache's budget, the
        packed copies') subtracts it from what is available now, as if the model had loaded."""
        if self.finished is not None:
            return 0
        done = (1 if self._outer.is_set() else 0) + self._loaded_layers
        return int(self.expected_bytes * sum(self.stage_shares[done:]))

    @property
    def loaded(self) -> bool:
        return self.finished is not None

    def progress(self) -> dict:
        """The loading state as plain data (/health, /v1/debug/engine)."""
        end = self.finished if self.finished is not None else time.monotonic()
        return {"loading": self.finished is None and self.error is None, "layers_loaded": self._loaded_layers,
                "num_layers": self.num_layers, "outer_loaded": self._outer.is_set() and self.error is None,
                "seconds": round(end - self.started, 3),
                "error": None if self.error is None else str(self.error)}
