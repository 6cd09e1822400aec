"""The core clients (pagoda/engine/core_client.py). The server's engine thread builds the core it
runs, so the thread that runs the model is the only one that leads an OpenMP team in the server's
process; LLMEngine and AsyncLLM, siblings over one front end, give the same tokens and stop at the
same stop string."""

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
from pagoda.sampling_params import RequestOutputKind
from pagoda.engine_args import EngineArgs
from pagoda.sampling_params import SamplingParams


def _config(model_dir, **kw):
    return create_engine_config(EngineArgs(model=str(model_dir), device="cpu", dtype="float32", **kw))


def test_the_async_engine_builds_its_core_on_the_engine_thread(tiny_llama, monkeypatch):
    built_on = []
    class RecordingCore(core_client.EngineCore):  # the real core, noting the thread that builds it
        def __init__(self, config):
            built_on.append(threading.current_thread().name)
            super().__init__(config)

    monkeypatch.setattr(core_client, "EngineCore", RecordingCore)
    llm = AsyncLLM(_config(tiny_llama, kv_cache_memory=0.05))
    try:
        assert built_on == ["pagoda-engine"]
        assert llm.core is llm.client.core and llm.input_processor.limits is llm.client.limits

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
    with pytest.raises(ValueError, match="does not hold one block"):
        AsyncLLM(_config(tiny_llama, kv_cache_memory=1e-9))


def test_a_stopped_engine_lets_go_of_its_core(tiny_llama):
    """What still holds an AsyncLLM once it is shut down (a task of its unloaded app not yet
    ended, a framework's cache) holds no model or KV cache."""
    llm = AsyncLLM(_config(tiny_llama, kv_cache_memory=0.05))
    core = weakref.ref(llm.core)
    llm.shutdown()
    gc.collect()
    assert core() is None
    assert llm.stats().num_running == 0  # the last stats still answer
    llm.shutdown()  # a second shutdown does nothing


def test_both_front_ends_give_the_same_samples_and_stop_strings(tiny_llama):
    """One input path and one output path: the in-process loop and the async engine give the
    same samples (n = 2, seeded) and end at the same stop string, which neither core sees."""
    config = _config(tiny_llama, kv_cache_memory=0.05)
    prompt = "Once upon a time"
    sync = LLMEngine(config)
    sync.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    probe = [o for o in sync.outputs() if o.finished][0].outputs[0].text
    stop = probe[len(probe) // 2:][:3]  # a piece of the greedy text: a stop string that hits
    requests = {"stopped": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                "sampled": SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=12, ignore_eos=True)}

    def finals(outputs) -> dict[str, list[tuple]]:
        return {o.request_id: [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
                for o in outputs if o.finished}

    for rid, params in requests.items():
        sync.add_request(rid, prompt, params.clone(output_kind=RequestOutputKind.FINAL_ONLY))
    want = finals(sync.outputs())
    sync.shutdown()

    llm = AsyncLLM(config)

    async def one(rid: str, params: SamplingParams) -> list[tuple]:
        text, ids, ends = {}, {}, {}
        async for out in llm.generate(prompt, params, rid):  # deltas, gathered per sample
            for c in out.outputs:
                text[c.index] = text.get(c.index, "") + c.text
                ids[c.index] = ids.get(c.index, []) + list(c.token_ids)
                if c.finish_reason is not None:
                    ends[c.index] = (c.finish_reason, c.stop_reason)
        return [(i, text[i], ids[i], *ends[i]) for i in sorted(text)]

    async def both():
        return dict(zip(requests, await asyncio.gather(*(one(rid, p) for rid, p in requests.items()))))

    try:
        got = asyncio.run(both())
    finally:
        llm.shutdown()
    assert got == want
    assert want["stopped"][0][3:] == ("stop", stop) and len(want["sampled"]) == 2
