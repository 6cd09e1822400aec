"""Shared fixtures: tiny random models (made locally) and the real SmolLM2 (pulled once).

The suite runs in a temporary `$PAGODA_HOME` (set here, at import, before pagoda reads it), so
what tests convert or compile never lands in the user's store. Two things are too costly to
redo every run and are shared with the user's real home through symlinks: `models/` (the
SmolLM2 wheel pulled from PyPI, sha256-checked) and `kernels/` (the C++ kernels, ~60 s to build
per CPU). Both are content the user's own `pagoda` would produce identically.

Every test that uses a real model (the `smollm2_gguf` or `gemma3_gguf` fixture, directly or through
another fixture) is marked `slow`, so `pytest -m "not slow"` is a quick run without them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_hf_model  # noqa: E402

SHARED_WITH_REAL_HOME = ("models", "kernels")


def _use_temporary_pagoda_home() -> Path:
    """Point PAGODA_HOME (inherited by the servers and scripts tests start) at a fresh directory
    whose `models` and `kernels` link to the real home's; removed at exit (the links, not their
    targets)."""
    real = Path(os.environ.get("PAGODA_HOME") or Path.home() / ".cache" / "pagoda").expanduser()
    home = Path(tempfile.mkdtemp(prefix="pagoda-test-home-"))
    for name in SHARED_WITH_REAL_HOME:
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    os.environ["PAGODA_HOME"] = str(home)
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    return home


PAGODA_TEST_HOME = _use_temporary_pagoda_home()


REAL_MODEL_FIXTURES = ("smollm2_gguf", "gemma3_gguf")


# The files that take longest (their tests' seconds, 2 xdist workers on the AVX2 EPYC, 2026-12-04,
# before that day's start-up change made every process-starting file 20-55 % shorter), longest first. `-n 2 --dist loadfile` hands out whole files in collection order (reordering by
# test count is switched off below: it sent these files, most with one to four tests, last, and
# the suite ended with one worker running them alone for ~6 minutes of its ~19).
LONGEST_FILES = (
    "layers/test_kernel_isa_levels.py",  # fallback-level kernel builds: 190 s (one level on an AVX2-only CPU)
    "test_packaging.py",  # a wheel's from-scratch kernel build: 110 s
    "e2e/test_gemma3_270m.py",  # 105 s
    "executor/test_tensor_parallel.py",  # 100 s
    "entrypoints/test_server.py",  # 100 s
    "e2e/test_smollm2.py",  # 80 s
    "entrypoints/test_reliability.py",  # 80 s
    "entrypoints/test_cli.py",  # 65 s
    "entrypoints/test_tensor_parallel_server.py",  # 60 s
    "entrypoints/test_fuzz.py",  # 60 s
    "entrypoints/test_soak.py",  # 55 s
    "tune/test_tune.py",  # 50 s
    "worker/test_compiled.py",  # 40 s
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in REAL_MODEL_FIXTURES):
            item.add_marker(slow)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    tests = Path(__file__).resolve().parent

    def order(item: pytest.Item) -> int:  # items outside tests/ (another path on the command line) keep their place
        return rank.get(item.path.relative_to(tests).as_posix(), len(rank)) if item.path.is_relative_to(tests) else len(rank)

    items.sort(key=order)  # stable: a file's tests stay together and in order

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_hf_model(arch, root / arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def long_tiny_llama(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama with a 16k context, so that one request can run long enough for a test to
    act while it is in flight (serve it with --max-model-len 16384)."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("long_tiny")
    for f in tiny_llama.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF from the catalog (pulled from PyPI on first use)."""
    from pagoda.loader import catalog

    return catalog.pull("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M GGUF (Q4_K_M) from the catalog (pulled from PyPI on first use, ~250 MB)."""
    from pagoda.loader import catalog

    return catalog.pull("gemma3-270m", quiet=True)


@pytest.fixture
def fresh_home(tmp_path, monkeypatch) -> Path:
    """An empty `$PAGODA_HOME` (so an empty store) whose kernels, catalog models and GGUF
    conversions are the suite's (links), so nothing is rebuilt."""
    suite_home = Path(os.environ["PAGODA_HOME"])
    home = tmp_path / "home"
    home.mkdir()
    for name in ("kernels", "models", "converted"):
        (suite_home / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to((suite_home / name).resolve(), target_is_directory=True)
    monkeypatch.setenv("PAGODA_HOME", str(home))
    return home


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
