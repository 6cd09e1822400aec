"""A model file that fails to load, in a server of several models (it loads on its first request):
the answer names the model and the loader's reason (here a zero-length tensor dimension), not
`keep_alive` as it did, and the other model keeps serving. One real `pagoda serve` on 127.0.0.1."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.server_process import start_server, stop_process


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-model")
    broken = root / "broken"
    shutil.copytree(tiny_model_dirs["llama"], broken)
    weights = load_file(broken / "model.safetensors")
    save_file({**weights, "model.norm.weight": torch.zeros(0)}, broken / "model.safetensors")
    models_file = root / "models.yaml"
    models_file.write_text(f"models:\n  - model: {broken}\n    served_model_name: broken\n"
                           f"  - model: {tiny_model_dirs['qwen2']}\n    served_model_name: good\n")
    proc, base = start_server(None, "--models-file", str(models_file), name=None)
    yield base
    stop_process(proc)


def test_a_model_that_fails_to_load_is_named_with_its_reason(server):
    reason = "tensor 'model.norm.weight' has a zero-length dimension: shape [0]"
    r = httpx.post(f"{server}/v1/completions", json={"model": "broken", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "model_load_failed" and error["param"] != "keep_alive"  # before: a 400 naming keep_alive
    assert "the model `broken` could not be loaded" in error["message"] and reason in error["message"]
    r = httpx.post(f"{server}/api/generate", json={"model": "broken", "prompt": "Hi", "stream": False}, timeout=60)
    assert r.status_code == 500 and reason in r.json()["error"], r.text
    r = httpx.post(f"{server}/api/generate", json={"model": "good", "prompt": "Hi", "keep_alive": "soon"}, timeout=60)
    assert r.status_code == 400 and "keep_alive" in r.json()["error"], r.text  # a bad keep_alive is still named
    r = httpx.post(f"{server}/v1/completions", json={"model": "good", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
