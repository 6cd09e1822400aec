"""The converted metadata directory (pagoda/loader/gguf_model_dir.py): cached under $PAGODA_HOME,
converted again only for a changed file, and a cached load never imports transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagoda.loader import gguf_model_dir
from pagoda.loader.gguf_model_dir import load_gguf_model_dir


def test_load_gguf_model_dir_caches(gguf_f32, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "home"))
    model = tmp_path / "model.gguf"
    model.write_bytes(gguf_f32["llama"].read_bytes())
    first = load_gguf_model_dir(model)
    assert first.parent == tmp_path / "home" / "converted"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in first.iterdir()}
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dir left behind

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_model_dir, "convert_gguf_metadata", no_conversion)
    assert load_gguf_model_dir(model) == first

    os.utime(model, ns=(1, 1))  # a changed file gets a fresh conversion
    with pytest.raises(AssertionError, match="converted twice"):
        load_gguf_model_dir(model)


_CACHED_LOAD_SCRIPT = """
import json, sys
from pathlib import Path
from pagoda.loader.gguf_model_dir import load_gguf_model_dir
from pagoda.loader.gguf_weights import iter_gguf_weights
already = "transformers" in sys.modules
model_dir = load_gguf_model_dir(Path(sys.argv[1]))
config = json.loads((model_dir / "config.json").read_text())
assert sum(1 for _ in iter_gguf_weights(Path(sys.argv[1]), config)) > 0
assert already or "transformers" not in sys.modules, "a cached load imported transformers"
"""


def test_cached_load_does_not_import_transformers(gguf_f32, tmp_path):
    env = dict(os.environ, PAGODA_HOME=str(tmp_path / "home"))
    path = str(gguf_f32["qwen3"])
    warm = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                           "from pagoda.loader.gguf_model_dir import load_gguf_model_dir; "
                           "load_gguf_model_dir(Path(sys.argv[1]))", path], env=env, capture_output=True, text=True)
    assert warm.returncode == 0, warm.stderr
    cached = subprocess.run([sys.executable, "-c", _CACHED_LOAD_SCRIPT, path], env=env, capture_output=True, text=True)
    assert cached.returncode == 0, cached.stderr
