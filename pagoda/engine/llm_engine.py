"""LLMEngine: the in-process engine loop (`LLM`, `pagoda generate | chat`, `pagoda.lang`).

A sibling of AsyncLLM over the same front end (engine/front_end.py: one input path, one output
path): here the core runs in the caller's thread and the caller steps it (`step`, `outputs`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

from pagoda.config import EngineArgs, EngineConfig, create_engine_config
from pagoda.engine.core import EngineCore
from pagoda.engine.core_client import InprocCoreClient
from pagoda.engine.front_end import FrontEnd
from pagoda.engine.input_processor import PromptType
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


class LLMEngine(FrontEnd):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._connect(InprocCoreClient(config))
        self._lock = threading.RLock()  # add / abort from other threads against step (pagoda.lang)
        # The content filter of add_request's requests (pagoda.engine.content_filter.Moderation;
        # LLM(moderation_words=...)): prompts checked, output filtered as it is generated.
        self.moderation = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(create_engine_config(args))

    @property
    def core(self) -> EngineCore:
        return self.client.core

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                    session_id: str | None = None, moderation=None, lora_request: LoRARequest | None = None) -> None:
        """Queue a request. `session_id` makes it a turn of a conversation: once it finishes, its
        prefix (prompt and answer) stays pinned in the prefix cache for the session's next turn,
        until `release_session`. `moderation` (default: the engine's) checks the prompt (a
        ContentFilterError, a ValueError, on a hit) and filters the output. `lora_request`: the
        LoRA adapter it runs under (the engine needs enable_lora)."""
        self.check_runner("generate")
        moderation = moderation if moderation is not None else self.moderation
        prepared = self.input_processor.prepare_request(request_id, prompt, params, priority, arrival_time,
                                                        cache_salt, session_id, lora_request)
        if moderation is not None:
            self.input_processor.check_prompt(prepared, moderation)
        with self._lock:
            self.submit(prepared, moderation)

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                            priority: int = 0) -> None:
        """Queue a pooling request (the pooling runner's): its one output is its vector."""
        prepared = self.prepare_pooling(request_id, prompt, params, priority)
        with self._lock:
            self.submit_pooling(prepared)

    def shutdown(self) -> None:
        self.client.shutdown()

    def stats(self) -> dict:
        """Scheduler and KV-cache figures, prefix-cache hit rate and memory pressure included."""
        s = self.client.stats()
        return {**dataclasses.asdict(s), "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                "memory_pressure": s.memory_pressure, "spec_acceptance_rate": s.spec_acceptance_rate,
                "spec_mean_accepted_length": s.spec_mean_accepted_length}

    def release_session(self, session_id: str) -> None:
        """The conversation ended: its pinned prefix becomes ordinary (evictable) cache."""
        with self._lock:
            self.client.release_sessions([session_id])

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self.abort(request_id)

    # -- the loop ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return (self.client.has_unfinished_requests() or self.output_processor.has_unfinished_requests()
                or bool(self.pooling_requests))

    def step(self) -> list[RequestOutput]:
        """One engine step. A step that raises aborts every request in flight (their KV blocks are
        freed), so no caller's loop steps a broken batch again, then re-raises."""
        with self._lock:
            try:
                return self.take_outputs(self.client.step())
            except Exception:
                for request_id in [*self.output_processor.requests, *self.pooling_requests]:
                    self.abort(request_id)
                raise

    def outputs(self) -> Iterator[RequestOutput]:
        """Step while any request is unfinished, yielding every output. Other threads may add or
        abort requests meanwhile (the engine is locked around each of those and each step)."""
        while self.has_unfinished_requests():
            yield from self.step()
