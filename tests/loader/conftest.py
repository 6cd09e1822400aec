"""Fixtures of the GGUF reader's tests (test_gguf_*.py): the tiny models (tests/tiny_models.py)
as F32 GGUF files, and those files converted to Hugging Face metadata directories."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_export import export_gguf

from pagoda.loader.gguf_model_dir import convert_gguf_metadata

GGUF_ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def gguf_f32(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_f32")
    return {arch: export_gguf(tiny_model_dirs[arch], root / f"{arch}.gguf") for arch in GGUF_ARCHS}


@pytest.fixture(scope="session")
def converted(gguf_f32, tmp_path_factory) -> dict[str, Path]:
    """convert_gguf_metadata output per architecture (imports transformers once, for the tokenizer)."""
    root = tmp_path_factory.mktemp("converted")
    return {arch: convert_gguf_metadata(path, root / arch) for arch, path in gguf_f32.items()}
