"""The scheduler's message to the workers for one step: plain, picklable data (no ``Request``).

The worker keeps its own state for every request it has seen (token ids, block table, sampling
parameters, generator) and updates it from these deltas, as vLLM v1's ``SchedulerOutput`` does;
the scheduler's ``Request`` objects never leave the scheduler. The same message goes to every
tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen: everything they need to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # None for a pooling request
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit, or 0
    # Tokens generated before the workers saw it (never today: a request is sent when first
    # scheduled; kept so a worker can be (re)built from the message alone).
    output_token_ids: list[int] = field(default_factory=list)
    # KV cache groups 1.. (core/kv_cache_groups.py): each group's block table, as long as block_ids
    group_block_ids: list[list[int]] = field(default_factory=list)
    pooling_params: PoolingParams | None = None  # a pooling request's: its vector comes back, no tokens
    lora_id: int = 0  # the LoRA adapter it runs under (0: the base model), held by the workers
    images: tuple[ImageInput, ...] = ()  # its prompt's images: pixels and placeholder runs (pagoda/multimodal)
    state_slot: int = -1  # state-space models: the slot of its recurrent state (core/state_slots.py)


@dataclass
class CachedRequestData:
    """A request the workers know: what changed since they last saw it."""

    req_id: str
    new_token_ids: list[int]  # tokens the scheduler appended (sampled) since the last message
    new_block_ids: list[int]  # appended to its block table, or the whole table when resumed
    num_computed_tokens: int  # tokens with KV in the cache before this step
    resumed_from_preemption: bool = False  # its blocks were freed: new_block_ids replace the table
    new_group_block_ids: list[list[int]] = field(default_factory=list)  # the same for KV cache groups 1..
    state_slot: int = -1  # resumed: the state slot it runs in now (state-space models)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request id → tokens to compute this step, in scheduling order (priority, then arrival);
    # with speculative decoding its last token plus its drafts
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # speculative decoding: request id → the draft tokens to verify after its last token
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # finished or aborted since the last message: the workers drop their state
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Structured outputs: the packed allowed-token bitmask (int32 [rows, ceil(V / 32)]), one row
    # per constrained request that samples this step (request id → row).
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: dict[str, int] = field(default_factory=dict)
    # LoRA (core/lora_residency.py): adapters to drop, then adapters to load, before the step runs
    lora_unloads: list[int] = field(default_factory=list)
    lora_loads: list[LoRARequest] = field(default_factory=list)
    # KV tiers (core/kv_tiers): before the forward pass, blocks to copy out (block, key, keep in
    # host memory), then blocks to copy in (key, block)
    kv_saves: list[tuple[int, bytes, bool]] = field(default_factory=list)
    kv_loads: list[tuple[bytes, int]] = field(default_factory=list)
    # State-space models (core/state_snapshots.py): before the forward pass, state slots to copy
    # (a kept prefix's state → a request that starts after it); during it, request id → the
    # snapshots its chunk writes (tokens into the chunk, slot)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_saves: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
