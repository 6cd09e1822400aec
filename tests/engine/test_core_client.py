"""The server's engine thread builds the core it runs (pagoda/engine/core_client.py), so the
thread that runs the model is the only one that leads an OpenMP team in the server's process."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from pagoda.config import create_engine_config
from pagoda.engine import core_client
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine_args import EngineArgs
from pagoda.sampling_params import SamplingParams


def _config(model_dir, **kw):
    return create_engine_config(EngineArgs(model=str(model_dir), device="cpu", dtype="float32", **kw))


def test_a_front_end_without_a_core_gets_one_built_on_the_engine_thread(tiny_llama, monkeypatch):
    built_on = []
    class RecordingCore(core_client.EngineCore):  # the real core, noting the thread that builds it
        def __init__(self, config):
            built_on.append(threading.current_thread().name)
            super().__init__(config)

    monkeypatch.setattr(core_client, "EngineCore", RecordingCore)
    engine = LLMEngine(_config(tiny_llama, kv_cache_memory=0.05), build_core=False)
    assert engine.core is None
    llm = AsyncLLM(engine)
    try:
        assert built_on == ["pagoda-engine"]
        assert engine.core is llm.client.core and engine.limits is llm.client.limits

        async def one() -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            ids: list[int] = []
            async for out in llm.generate({"prompt_token_ids": [1, 5, 9]}, params, "r1"):
                ids += out.outputs[0].token_ids
            return ids

        assert len(asyncio.run(one())) == 4
    finally:
        llm.client.shutdown()


def test_a_core_that_fails_to_build_on_the_thread_fails_the_front_end(tiny_llama):
    engine = LLMEngine(_config(tiny_llama, kv_cache_memory=1e-9), build_core=False)
    with pytest.raises(ValueError, match="does not hold one block"):
        AsyncLLM(engine)


def test_a_stopped_engine_lets_go_of_its_core(tiny_llama):
    """What still holds an AsyncLLM once it is shut down (a task of its unloaded app not yet
    ended, a framework's cache) holds no model or KV cache."""
    engine = LLMEngine(_config(tiny_llama, kv_cache_memory=0.05), build_core=False)
    llm = AsyncLLM(engine)
    core = weakref.ref(engine.core)
    llm.shutdown()
    gc.collect()
    assert core() is None
    assert llm.stats().num_running == 0  # the last stats still answer
    llm.shutdown()  # a second shutdown does nothing
