"""Ollama's own store, read in place: ``$OLLAMA_MODELS``, else ``~/.ollama/models``.

``ollama:NAME[:TAG]`` names a model there (``--model ollama:smollm2``, ``pagoda show``,
``pagoda cp ollama:smollm2 mine``). pagoda never writes to it.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagoda.store.layout import Ref, StoreLayout, parse_ref

PREFIX = "ollama:"


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def ollama_layout() -> StoreLayout:
    return StoreLayout(ollama_root(), read_only=True)


def is_ollama_name(text: str) -> bool:
    return text.startswith(PREFIX)


def parse_ollama_name(text: str) -> Ref:
    if not is_ollama_name(text):
        raise ValueError(f"{text!r} does not start with {PREFIX!r}")
    return parse_ref(text[len(PREFIX):])
