"""Progressive loading (loader/progressive_load.py): a model loaded one layer at a time on a loader
thread gives the tokens of the whole-model load, fp32 and with a GGUF's blocks; a request that
runs into a layer still loading waits for it and completes with the same tokens; the fused decode
stack is chosen once every layer is in; models it does not apply to load whole."""

from __future__ import annotations

import threading

import pytest
import torch
from gguf_export import export_gguf

from pagoda import LLM, SamplingParams
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine_args import EngineArgs
from pagoda.distributed.parallel_state import SINGLE
from pagoda.loader import progressive_load
from pagoda.loader.model_loader import load_model
from pagoda.loader.resolve import resolve_model
from pagoda.models.layer_readiness import LoadFailed
from pagoda.models.llama import LlamaForCausalLM

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def main():"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _engine_mid_load(model) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(model), dtype="float32", kv_cache_memory=0.02,
                                                 progressive_load=True))


def _generate(engine: LLMEngine) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    done = {out.request_id: out.outputs[0].token_ids for out in engine.outputs() if out.finished}
    return [done[str(i)] for i in range(len(PROMPTS))]


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _engines(model: str, **args) -> tuple[LLM, LLM]:
    whole = LLM(model=model, kv_cache_memory=0.02, progressive_load=False, **args)
    layered = LLM(model=model, kv_cache_memory=0.02, progressive_load=True, **args)
    return whole, layered


@pytest.fixture(scope="module")
def q4_gguf(tiny_llama, tmp_path_factory):
    return export_gguf(tiny_llama, tmp_path_factory.mktemp("progressive") / "llama-Q4_0.gguf", "Q4_0")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_by_layer_gives_the_whole_loads_tokens(tiny_llama, dtype):
    whole, layered = _engines(str(tiny_llama), dtype=dtype)
    assert layered.engine.core.loading_progress() is not None  # it did load layer by layer
    assert whole.engine.core.loading_progress() is None
    assert _tokens(layered) == _tokens(whole)


def test_gguf_blocks_layer_by_layer_give_the_same_tokens(q4_gguf):
    whole, layered = _engines(str(q4_gguf), quantization="gguf", dtype="float32")
    assert _tokens(layered) == _tokens(whole)
    kinds = lambda llm: [type(m).__name__ for m in llm.engine.core.model.modules()]  # noqa: E731
    assert kinds(layered) == kinds(whole)  # the same quantized and packed layers
    assert layered.engine.core.runner.forward_path == whole.engine.core.runner.forward_path  # chosen once loaded
    snapshot = layered.engine.core.debug_snapshot("engine")  # what /v1/debug/engine shows
    assert snapshot["config"]["forward"] == whole.engine.core.debug_snapshot("engine")["config"]["forward"]
    assert snapshot["config"]["loading"]["layers_loaded"] == snapshot["config"]["loading"]["num_layers"]


def test_a_request_during_loading_waits_for_each_layer(tiny_llama, monkeypatch):
    """The loader is held before layer 1; a request submitted then starts its forward pass, waits at
    layer 1, and completes once the loader goes on, with the whole load's tokens."""
    expected = _tokens(LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, progressive_load=False))
    release, reached = threading.Event(), threading.Event()

    def hold(stage: int) -> None:
        if stage == 2:  # before layer 1
            reached.set()
            release.wait()

    monkeypatch.setattr(progressive_load, "stage_hook", hold)
    engine = _engine_mid_load(tiny_llama)  # (an LLM returns loaded)
    assert reached.wait(60)
    progress = engine.core.loading_progress()
    assert progress["loading"] and progress["layers_loaded"] == 1, progress
    assert not engine.core.forward_path["fused_decode"]  # the Python layers while loading
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_generate(engine)))
    worker.start()
    try:
        worker.join(timeout=0.5)
        assert worker.is_alive() and not result  # waiting for layer 1
    finally:
        release.set()  # (the loader thread is joined at exit: never leave it held)
    worker.join(timeout=120)
    assert result == [expected]
    engine.core.wait_until_loaded()
    assert not engine.core.loading_progress()["loading"]
    assert engine.core.model.loading is None  # nothing is checked per step any more


def test_a_failed_load_fails_the_waiting_forward(tiny_llama, monkeypatch):
    def fail(stage: int) -> None:
        if stage == 1:
            raise OSError("disk gone")

    monkeypatch.setattr(progressive_load, "stage_hook", fail)
    files, config = _files(tiny_llama)
    model = load_model(files, config, torch.float32, torch.device("cpu"), 64, progressive=True)
    with pytest.raises(LoadFailed, match="disk gone"):
        list(model.loading.as_ready(model.layers))
    assert model.loading.progress()["error"] == "disk gone"


def test_shutting_down_mid_load_stops_the_loader(tiny_llama, monkeypatch):
    release, reached = threading.Event(), threading.Event()

    def hold(stage: int) -> None:
        if stage == 1:
            reached.set()
            release.wait()

    monkeypatch.setattr(progressive_load, "stage_hook", hold)
    engine = _engine_mid_load(tiny_llama)
    readiness = engine.core.model.load_readiness
    try:
        assert reached.wait(60)
        engine.core.shutdown()
    finally:
        release.set()
    with pytest.raises(LoadFailed, match="shut down"):
        readiness.wait_loaded()
    assert readiness.progress()["layers_loaded"] == 0


def test_memory_sizing_counts_the_layers_still_to_come(q4_gguf, monkeypatch):
    """While the model loads, what its missing parts will take is known from the file's bytes and
    the parameters' shapes: the KV budget subtracts it (Worker._available_once_loaded)."""
    release, reached = threading.Event(), threading.Event()

    def hold(stage: int) -> None:
        if stage == 1:  # the outer weights in, no layer yet
            reached.set()
            release.wait()

    monkeypatch.setattr(progressive_load, "stage_hook", hold)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(q4_gguf), quantization="gguf", dtype="float32",
                                                   kv_cache_memory=0.02, progressive_load=True))
    readiness = engine.core.model.load_readiness
    try:
        assert reached.wait(60)
        assert readiness.expected_bytes == q4_gguf.stat().st_size  # the GGUF's blocks are kept
        shares = readiness.stage_shares
        assert sum(shares) == pytest.approx(1.0) and len(shares) == 1 + len(engine.core.model.layers)
        assert readiness.pending_bytes() == int(readiness.expected_bytes * sum(shares[1:]))
    finally:
        release.set()
    engine.core.wait_until_loaded()
    assert readiness.pending_bytes() == 0


def _files(path):
    files = resolve_model(str(path))
    return files, files.hf_config()


def test_what_loads_whole_says_why(tiny_llama):
    files, _ = _files(tiny_llama)

    class OwnLoader(LlamaForCausalLM):
        def load_weights(self, weights, expect=None):
            return super().load_weights(weights)

    cpu = torch.device("cpu")
    assert progressive_load.refusal(LlamaForCausalLM, files, cpu, SINGLE) is None
    assert "its own way" in progressive_load.refusal(OwnLoader, files, cpu, SINGLE)
    assert "cuda" in progressive_load.refusal(LlamaForCausalLM, files, torch.device("cuda"), SINGLE)


def test_the_pooling_runner_loads_whole_and_says_why(tiny_llama, caplog):
    with caplog.at_level("INFO", logger="pagoda.worker.worker"):
        llm = LLM(model=str(tiny_llama), runner="pooling", dtype="float32", kv_cache_memory=0.02,
                  progressive_load=True)
    assert llm.engine.core.loading_progress() is None
    assert "progressive loading off: the pooling runner" in caplog.text


def test_stage_of_names():
    assert progressive_load.stage_of("model.embed_tokens.weight") == 0
    assert progressive_load.stage_of("lm_head.weight") == 0
    assert progressive_load.stage_of("model.layers.0.mlp.up_proj.weight") == 1
    assert progressive_load.stage_of("layers.11.self_attn.qkv_proj.weight") == 12
