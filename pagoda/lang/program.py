"""`@function` programs: run one, or many concurrently, against a backend."""

from __future__ import annotations

import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pagoda.lang.state import ProgramState

_default_backend = None


def set_default_backend(backend) -> None:
    """The backend that `run` and `run_batch` use when none is given (an Engine or Endpoint)."""
    global _default_backend
    _default_backend = backend


def _backend(backend):
    backend = backend or _default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=pagoda.lang.Engine(...) or Endpoint(url), or call set_default_backend")
    return backend


class Program:
    """A generation program: a function whose first argument is the state it appends to."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        params = list(inspect.signature(fn).parameters)
        if not params:
            raise TypeError(f"{fn.__name__} must take the program state as its first argument")
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args, backend=None, session_id: str | None = None, **kwargs) -> ProgramState:
        """Run on a fresh state; `session_id` makes every request a turn of that session (its
        prefix stays pinned in the engine's prefix cache until `Engine.release_session`)."""
        state = ProgramState(_backend(backend), session_id=session_id)
        self.fn(state, *args, **kwargs)
        return state.finish()

    def run_batch(self, batch: list[dict[str, Any]], *, backend=None, num_threads: int = 64) -> list[ProgramState]:
        """Run the program once per keyword-argument dict, concurrently; states in order."""
        backend = _backend(backend)
        if not batch:
            return []
        with ThreadPoolExecutor(max_workers=min(num_threads, len(batch)), thread_name_prefix="pagoda-lang-run") as pool:
            return list(pool.map(lambda kwargs: self.run(backend=backend, **kwargs), batch))

    def __call__(self, state: ProgramState, *args, **kwargs):
        """Call a program from inside another: it appends to the caller's state."""
        return self.fn(state, *args, **kwargs)


def function(fn: Callable[..., Any]) -> Program:
    """Decorator: `@function def prog(s, ...): s += ...`."""
    return Program(fn)
