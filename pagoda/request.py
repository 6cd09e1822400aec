"""A request as the engine core sees it: token ids, sampling params and progress counters.

One rule keeps the scheduler simple (vLLM v1): a request has `num_tokens` (prompt + output) and
`num_computed_tokens` (how many of those have KV in the cache). Each step gives it some of the
tokens not yet computed. Prefill, chunked prefill and decode are the same thing.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput, cache_token_ids
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.structured_output.manager import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self._finished  # set below: a set lookup would hash the member in Python, every step

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
for _status in RequestStatus:
    _status._finished = _status in _FINISH_REASONS
    _status._finish_reason = _FINISH_REASONS.get(_status)
_arrival_counter = itertools.count()


@dataclass
class EngineCoreRequest:
    """What a front end sends the core (as vLLM's EngineCoreRequest): a prompt's token ids and one
    sample's parameters (n > 1 is n of these), or for the pooling runner its pooling parameters
    (``sampling_params`` None: it computes its prompt and ends). The core makes a ``Request`` of it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    session_id: str | None = None  # a conversation's turn: its prefix stays pinned for the next turn
    pooling_params: PoolingParams | None = None  # a pooling request's (the pooling runner's only kind)
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)
    images: tuple[ImageInput, ...] = ()  # the prompt's images and their placeholder runs (pagoda/multimodal)


@dataclass
class Request(EngineCoreRequest):
    """A core request as the scheduler tracks it: the message's fields and its progress. Only the
    scheduler writes it (tests/core/test_request_writers.py)."""

    # A strictly increasing tie-breaker: arrival_time can tie on coarse clocks.
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    group_block_ids: list[list[int]] = field(default_factory=list)  # KV cache groups 1.. (hybrid models)
    state_slot: int | None = None  # state-space models: its recurrent state's slot while it runs (core/state_slots.py)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Prompt logprobs are produced chunk by chunk; this counts positions already reported.
    num_prompt_logprobs_done: int = 0
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (first admission)
    # Speculative decoding: the drafts the worker proposed after its last token, to verify next.
    spec_token_ids: list[int] = field(default_factory=list)
    # The compiled constraint and its matcher (structured outputs); given by Scheduler.add_request.
    grammar: "GrammarState | None" = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @classmethod
    def of(cls, message: EngineCoreRequest) -> Request:
        """The core's request for a front end's message: its fields, nothing scheduled yet."""
        return cls(**{f.name: getattr(message, f.name) for f in fields(EngineCoreRequest)})

    @property
    def prefix_key(self) -> object:
        """What the prefix cache keys this request's blocks under: its salt, and its adapter's
        files when it runs under one (two adapters, or an adapter and the base, never share KV)."""
        if self.lora_request is None:
            return self.cache_salt
        return (self.cache_salt, *self.lora_request.prefix_key)

    @property
    def cache_token_ids(self) -> list[int]:
        """The ids the prefix cache keys its blocks on: ``all_token_ids``, with each image's
        placeholder tokens standing for a hash of its pixels (the same image is a hit, another
        image behind the same placeholders never is)."""
        if not self.images:
            return self.all_token_ids
        return cache_token_ids(self.all_token_ids, self.images)

    @property
    def lora_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def waiting_for_grammar(self) -> bool:
        """Its constraint is still compiling: the scheduler must not admit it yet."""
        return self.grammar is not None and not self.grammar.is_ready()

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
