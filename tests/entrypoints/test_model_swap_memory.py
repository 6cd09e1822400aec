"""A server of several models that swaps them (`--max-loaded-models 1`) gives each unloaded
model's memory back: its resident memory after many swaps stays at the plateau of the first ones.
Before pagoda/entrypoints/app_memory.py and the engine's shutdown letting go of its core, each
load kept the model it replaced: ~ a whole model per swap.

Two random-weight Llamas of 55 MiB each (fp32), so that a model kept per swap stands far above
the noise of a few MiB. The 100-swap soak (pagoda/bench/swap_soak.py) and its figures:
benchmarks/model_swap_soak.py, benchmarks/README.md "Swapping models: memory"."""

from __future__ import annotations

import asyncio
import shutil
import weakref

import httpx

from pagoda.bench.swap_soak import swap
from tests.entrypoints.test_several_models import _pool
from tests.server_process import start_server, stop_process
from tests.tiny_models import make_tiny_hf_model

MiB = 1 << 20
SIZE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2)
SWAPS = 14


def test_swapping_two_models_keeps_memory_at_its_first_plateau(tmp_path):
    first = make_tiny_hf_model("llama", tmp_path / "first", **SIZE)
    second = shutil.copytree(first, tmp_path / "second")  # a model of its own to the server
    weights = (first / "model.safetensors").stat().st_size
    proc, base = start_server(None, "--model", str(first), "--model", str(second), "--served-model-name", "first",
                              "second", "--max-loaded-models", "1", "--keep-alive", "-1", name=None)
    try:
        report = swap(base, ["first", "second"], SWAPS, proc.pid)
        assert [m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"]] == ["second"]
        loads = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
                    if line.startswith("pagoda:model_loads_total{"))
    finally:
        stop_process(proc)
    assert loads == SWAPS  # each request unloaded the other model and loaded its own
    # A model kept per swap would add 55 MiB a swap, ~700 MiB by the end. The bounds: less than one
    # model in all after the plateau, and less than half a model over the second half of the swaps.
    # (Twice in CI the RSS stepped up ~32 MiB once, at the fourth swap, and stayed flat for the
    # ten after: a high-water mark of the allocator's, not a model kept per swap.)
    rss = [round(r / MiB) for r in report.rss]
    assert report.end - report.plateau < weights, f"RSS grew past a model (weights {weights / MiB:.0f} MiB): {rss}"
    late = report.rss[SWAPS // 2:]
    assert report.end - min(late) < weights / 2, f"RSS still growing in the second half of the swaps: {rss}"


def test_nothing_keeps_an_unloaded_models_app_or_engine(tiny_llama):
    """FastAPI's caches of endpoints held every unloaded model's engine (the endpoints are
    closures over it), and with it the weights until the engine let go of its core; the pool's
    unload clears them."""
    pool = _pool({"llama": tiny_llama}, ["llama"], memory_budget=1 << 30, max_loaded=1, load_timeout=30)

    async def load_and_unload() -> list[weakref.ref]:
        model = await pool.acquire(pool.specs[0])
        kept = [weakref.ref(model.app), weakref.ref(model.engine), weakref.ref(model.engine.core)]
        pool.release(model)
        assert await pool.unload_now(pool.specs[0])
        return kept

    app, engine, core = asyncio.run(load_and_unload())
    assert (app(), engine(), core()) == (None, None, None)
