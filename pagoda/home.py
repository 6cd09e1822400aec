"""Where pagoda keeps its files: ``$PAGODA_HOME``, default ``~/.cache/pagoda``.

Its own module, importing nothing of pagoda's, so the kernel builder, the compiler cache and the
GGUF converter reach it without importing the model catalog.
"""

from __future__ import annotations

from pathlib import Path

from pagoda import envs


def pagoda_home() -> Path:
    """``$PAGODA_HOME``, default ``~/.cache/pagoda`` (read on every call so tests can override it)."""
    return envs.PAGODA_HOME
