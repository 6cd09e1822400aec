"""A value in force for the extent of a ``with`` block, in the thread that set it: how the model
being built reads its tensor-parallel group and backend, and a forward pass its attention
metadata, without threading them through every constructor and ``forward`` signature."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Generic, TypeVar

T = TypeVar("T")


class Scoped(Generic[T]):
    def __init__(self, name: str, default: T) -> None:
        self._var: ContextVar[T] = ContextVar(name, default=default)

    def get(self) -> T:
        return self._var.get()

    @contextlib.contextmanager
    def using(self, value: T) -> Iterator[None]:
        token = self._var.set(value)
        try:
            yield
        finally:
            self._var.reset(token)
