"""LLMEngine: the synchronous front end over EngineCore.

Turns prompts (text or token ids) into core requests, fans `n > 1` out into n core requests,
and turns core outputs back into RequestOutputs. `LLM`, the CLI and `pagoda.lang` run its loop
(`outputs`); the server uses its front half (`prepare_request`, the output processor) on the
event loop, while the core steps on its own thread or process (core_client.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pagoda.config import EngineArgs, EngineConfig, create_engine_config
from pagoda.engine.content_filter import ContentFilterError
from pagoda.engine.core import EngineCore, RequestLimits
from pagoda.engine.output_processor import OutputProcessor
from pagoda.generation_defaults import sampling_defaults
from pagoda.outputs import RequestOutput
from pagoda.request import EngineCoreRequest, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.grammar import validate_structured_outputs
from pagoda.tokenizer import Tokenizer

PromptType = str | dict[str, Any]


@dataclass
class PreparedRequest:
    """A request ready for the core (its n core requests) and for the output processor."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[tuple[str, SamplingParams]]
    core_requests: list[EngineCoreRequest]
    arrival_time: float

    def output_args(self) -> tuple:
        return self.request_id, self.prompt, self.prompt_token_ids, self.samples, self.arrival_time


class LLMEngine:
    def __init__(self, config: EngineConfig, *, build_core: bool = True) -> None:
        """build_core=False makes a front end without a model (the server's engine process has
        the core); `limits` must then be set from the core before requests are prepared."""
        self.config = config
        self.tokenizer = Tokenizer(config.model.files.metadata_dir, chat_template=config.model.chat_template)
        self.core: EngineCore | None = EngineCore(config) if build_core else None
        self.limits: RequestLimits | None = self.core.limits if self.core else None
        self.output_processor = OutputProcessor(self.tokenizer)
        self._lock = threading.RLock()  # add / abort from other threads against step (pagoda.lang)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        # The model's own defaults for what a request leaves unset (generation_defaults.py)
        self.sampling_defaults = sampling_defaults(config.model.generation_config, config.model.files.metadata_dir)
        # The content filter of add_request's requests (pagoda.engine.content_filter.Moderation;
        # LLM(moderation_words=...)): prompts checked, output filtered as it is generated.
        self.moderation = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(create_engine_config(args))

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # -- input ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")

    def prepare_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                        priority: int = 0, arrival_time: float | None = None,
                        cache_salt: str | None = None, session_id: str | None = None) -> PreparedRequest:
        """Tokenize, fan n > 1 out, build and validate the core requests; queue nothing.

        Thread-safe (it reads only immutable engine state), so the server runs it on the HTTP side.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        validate_structured_outputs(params.structured_outputs)
        text, prompt_ids = self.tokenize_prompt(prompt)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = str(prompt["cache_salt"])  # vLLM's way: the salt rides with the prompt
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        samples = self._fan_out(request_id, params)
        requests = []
        for core_id, child in samples:
            child.all_stop_token_ids = set(self.eos_token_ids)
            requests.append(EngineCoreRequest(core_id, prompt_ids, child, priority=priority, arrival_time=arrival_time,
                                              cache_salt=cache_salt, session_id=session_id))
        self.limits.validate(requests[0])  # the children share the prompt
        return PreparedRequest(request_id, text, prompt_ids, samples, requests, arrival_time)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                    session_id: str | None = None, moderation=None) -> None:
        """Queue a request. `session_id` makes it a turn of a conversation: once it finishes, its
        prefix (prompt and answer) stays pinned in the prefix cache for the session's next turn,
        until `release_session`. `moderation` (default: the engine's) checks the prompt (a
        ContentFilterError, a ValueError, on a hit) and filters the output."""
        moderation = moderation if moderation is not None else self.moderation
        prepared = self.prepare_request(request_id, prompt, params, priority, arrival_time, cache_salt, session_id)
        if moderation is not None:
            text = prepared.prompt if prepared.prompt is not None else self.tokenizer.decode(prepared.prompt_token_ids)
            name = moderation.check_input(text)
            if name is not None:
                raise ContentFilterError(name)
        with self._lock:
            if request_id in self.output_processor.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            for request in prepared.core_requests:
                self.core.add_request(request)
            self.output_processor.add_request(*prepared.output_args(), moderation=moderation)

    @staticmethod
    def _fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """n > 1 runs as n core requests; child i of a seeded request uses seed + i."""
        if params.n == 1:
            return [(request_id, params)]
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            children.append((f"{i}_{request_id}", params.clone(n=1, seed=seed)))
        return children

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()

    def stats(self) -> dict:
        """Scheduler and KV-cache figures, prefix-cache hit rate and memory pressure included."""
        s = self.core.stats()
        return {**dataclasses.asdict(s), "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
                "memory_pressure": s.memory_pressure, "spec_acceptance_rate": s.spec_acceptance_rate,
                "spec_mean_accepted_length": s.spec_mean_accepted_length}

    def release_session(self, session_id: str) -> None:
        """The conversation ended: its pinned prefix becomes ordinary (evictable) cache."""
        with self._lock:
            self.core.release_sessions([session_id])

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self.core.abort_requests(self.output_processor.core_ids(request_id))
            self.output_processor.abort_request(request_id)

    # -- the loop ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step. A step that raises aborts every request in flight (their KV blocks are
        freed), so no caller's loop steps a broken batch again, then re-raises."""
        with self._lock:
            try:
                outputs, to_stop = self.output_processor.process_outputs(self.core.step())
            except Exception:
                for request_id in list(self.output_processor.requests):
                    self.core.abort_requests(self.output_processor.core_ids(request_id))
                    self.output_processor.abort_request(request_id)
                raise
            if to_stop:
                self.core.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
            return outputs

    def outputs(self) -> Iterator[RequestOutput]:
        """The in-process engine loop (``LLM``, ``pagoda generate | chat``, ``pagoda.lang``): step
        while any request is unfinished, yielding every output. Other threads may add or abort
        requests meanwhile (the engine is locked around each of those and each step). The server
        drives the core through ``core_client``'s loop instead: its front end runs on the event loop."""
        while self.has_unfinished_requests():
            yield from self.step()
