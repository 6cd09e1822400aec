"""/health while the model loads layer by layer, through a real `pagoda serve` on 127.0.0.1: 503
``model_loading`` by default (200 keeps meaning "ready at normal latency"), 200 with
``--ready-when serving``, both with the ``X-Pagoda-Loading`` header; a request sent while the
layers load is taken and completes with the whole load's tokens. The loader waits
PAGODA_TEST_LAYER_LOAD_DELAY seconds before each layer, so the load outlasts the server's start;
what is checked does not depend on that timing but for the first answer being seen mid-load."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import torch

from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from server_process import _free_port

DELAY = "3"  # seconds before each of the tiny model's 2 layers
PROMPT = "The quick brown fox"


def _serve(model, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model), "--port", str(port), "--dtype",
           "float32", "--kv-cache-memory", "0.02", "--served-model-name", "tiny", "--log-level", "warning", "--progressive-load", *extra]
    env = dict(os.environ, PAGODA_TEST_LAYER_LOAD_DELAY=DELAY)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _first_answer(proc: subprocess.Popen, base: str) -> httpx.Response:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            return httpx.get(f"{base}/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)  # not listening yet: poll again
    raise AssertionError("the server never answered")


def _until_loaded(base: str) -> httpx.Response:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        answer = httpx.get(f"{base}/health", timeout=5)
        if "x-pagoda-loading" not in answer.headers:
            return answer
        time.sleep(0.2)  # the load's pace, not a condition of the test
    raise AssertionError("the model never finished loading")


@pytest.fixture(scope="module")
def expected(tiny_llama) -> str:
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, progressive_load=False)
    return llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("ready_when, status_while_loading", [("loaded", 503), ("serving", 200)])
def test_health_while_loading_and_a_request_sent_then(tiny_llama, expected, ready_when, status_while_loading):
    proc, base = _serve(tiny_llama, "--ready-when", ready_when)
    try:
        first = _first_answer(proc, base)
        assert first.status_code == status_while_loading, first.text
        loaded, layers = map(int, first.headers["x-pagoda-loading"].split("/"))
        assert layers == 2 and loaded < layers
        if status_while_loading == 503:
            assert first.json()["error"]["code"] == "model_loading"
        else:
            assert first.json()["status"] == "loading"
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)  # sent mid-load: waits for the layers
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
        done = _until_loaded(base)
        assert done.status_code == 200
        engine = httpx.get(f"{base}/v1/debug/engine", timeout=30).json()
        assert engine["config"]["loading"]["layers_loaded"] == 2 and not engine["config"]["loading"]["loading"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_model_that_fails_to_load_stops_the_server(tiny_llama, tmp_path):
    """A bad tensor found by the loader's thread once the server listens: the server stops with
    exit 1, naming the reason, as a whole-model load that failed before listening did."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    weights = load_file(broken / "model.safetensors")
    save_file({**weights, "model.layers.1.input_layernorm.weight": torch.zeros(0)}, broken / "model.safetensors")
    proc, _ = _serve(broken)
    assert proc.wait(timeout=120) == 1
