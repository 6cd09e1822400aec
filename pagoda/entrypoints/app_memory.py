"""The memory of an unloaded model, given back (model_pool.py's unload).

What kept an unloaded model's weights, KV cache and tokenizer in the server's memory:

- FastAPI classifies each route's endpoint (coroutine? generator?) through module-level
  ``functools.lru_cache``s of 4,096 entries keyed by the endpoint function itself (fastapi
  0.165's ``dependencies/models.py``). pagoda's endpoints are closures over their model's engine
  and serving state (api_server.build_app), so those caches kept every unloaded model reachable
  until some 4,096 later entries pushed it out: the server grew by a whole model per load. The
  caches are cleared after each unload; a loaded model's endpoint is classified again on its next
  request (microseconds). A FastAPI without them makes this a no-op, and
  tests/entrypoints/test_model_swap_memory.py catches any cache that does the same.
- An engine is a reference cycle (its core client calls back into its AsyncLLM), freed only by a
  collection, and two things still held it when the pool collected: the thread that had run its
  shutdown (a `to_thread` worker keeps its work item a moment after answering), and the app's
  session sweeper, cancelled by the shutdown hooks but not yet ended. Each time the model stayed
  until the next unload. So one thread stops the engine, drops every reference it had, then
  collects, and the pool lets the cancelled tasks end first (model_pool.py). The engine itself
  lets go of its core on shutdown (AsyncLLM.shutdown), whoever still holds it.
- The freed weights lie in glibc's heaps, which pagoda/heap.py tells to keep up to 512 MiB free
  for the next step's activations: a trim gives them to the kernel.
"""

from __future__ import annotations

import gc
from typing import Any

from fastapi.dependencies import models as fastapi_models

from pagoda.heap import release_freed_memory

_FASTAPI_CACHES = ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached")


def forget_endpoints() -> int:
    """Clear FastAPI's caches that hold route endpoints; how many there were."""
    caches = [getattr(fastapi_models, name, None) for name in _FASTAPI_CACHES]
    caches = [cache for cache in caches if callable(getattr(cache, "cache_clear", None))]
    for cache in caches:
        cache.cache_clear()
    return len(caches)


def stop_and_release(model: Any) -> None:
    """Stop a LoadedModel's engine, drop its app and engine, and give their memory back: FastAPI's
    caches cleared, the reference cycles collected, the heap trimmed. Blocking: run it on a thread,
    the model's own shutdown hooks already run."""
    engine, model.app, model.engine = model.engine, None, None
    engine.shutdown()
    del engine  # this frame's reference, before the collection
    forget_endpoints()
    gc.collect()
    release_freed_memory()
