"""The worker's own record of every request it runs, kept from step to step (vLLM's InputBatch).

The scheduler sends deltas (``SchedulerOutput``); this applies them to persistent arrays, one row
per request: its token ids, its block table, its sampling parameters. A step then gathers the
rows it needs with numpy indexing instead of rebuilding the batch from Python lists. Rows are
kept for preempted requests (their generator must continue where it stopped) and dropped when
the scheduler reports a request finished.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.multimodal.inputs import ImageInput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What only a few requests have (kept per request, not in the arrays)."""

    req_id: str
    sampling_params: SamplingParams | None  # None for a pooling request
    generator: torch.Generator | None
    num_prompt_logprobs_done: int = 0  # prompt positions already reported
    pooling_params: PoolingParams | None = None  # a pooling request's (worker/pooling_runner.py)
    images: tuple[ImageInput, ...] = ()  # its prompt's images (worker/image_embeddings.py)


class InputBatch:
    def __init__(self, max_model_len: int, block_size: int, capacity: int = 16, num_kv_groups: int = 1,
                 tracks_states: bool = False) -> None:
        """``num_kv_groups``: block tables per request (core/kv_cache_groups.py); group 0's is
        ``block_table``, and every group's table has the same length. ``tracks_states``: the model
        keeps recurrent state (``state_slots``: each request's slot; batch_layout.py tells the
        layers)."""
        self.tracks_states = tracks_states
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_groups = num_kv_groups
        self.max_blocks = -(-max_model_len // block_size)
        self.index: dict[str, int] = {}  # request id → row
        self.states: dict[str, RequestState] = {}
        self.prompt_logprob_ids: set[str] = set()  # requests that asked for prompt logprobs
        # requests whose sampling needs a look at their parameters one by one: a seed, logit
        # bias, min_tokens or logprobs (the rest of a batch is gathered from the arrays)
        self.special_ids: set[str] = set()
        self.version = 0  # bumped when a request is added or removed (what caches of the rows key on)
        self._free_rows: list[int] = []
        self._capacity = 0
        self._grow(capacity)

    # -- storage ----------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        def resized(old: np.ndarray | None, shape: tuple, dtype, fill=0) -> np.ndarray:
            new = np.full(shape, fill, dtype=dtype)
            if old is not None:
                new[: old.shape[0]] = old
            return new

        get = lambda name: getattr(self, name, None)  # noqa: E731
        self.token_ids = resized(get("token_ids"), (capacity, self.max_model_len), np.int64)
        old_tables = get("block_tables")
        self.block_tables = np.zeros((self.num_kv_groups, capacity, self.max_blocks), dtype=np.int64)
        if old_tables is not None:
            self.block_tables[:, : old_tables.shape[1]] = old_tables
        for name, dtype, fill in _ROW_FIELDS:
            setattr(self, name, resized(get(name), (capacity,), dtype, fill))
        self._free_rows.extend(range(capacity - 1, self._capacity - 1, -1))
        self._capacity = capacity

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow(self._capacity * 2)
        return self._free_rows.pop()

    # -- deltas -----------------------------------------------------------------------------
    def apply(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.remove(rid)
        for new in sched.new_requests:
            self.add(new)
        self._update_all(sched.cached_requests)
        for req_id, drafts in sched.scheduled_spec_tokens.items():
            # inputs after the last token, for this step only: the next message's new tokens
            # (what was accepted) overwrite them
            row = self.index[req_id]
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(drafts)] = drafts

    def add(self, new: NewRequestData) -> None:
        if new.req_id in self.index:
            self.remove(new.req_id)
        self.version += 1
        row = self._take_row()
        self.index[new.req_id] = row
        p = new.sampling_params
        generator = torch.Generator().manual_seed(p.seed) if p is not None and p.seed is not None else None
        self.states[new.req_id] = RequestState(new.req_id, p, generator, pooling_params=new.pooling_params,
                                               images=new.images)
        if p is not None and p.prompt_logprobs is not None:
            self.prompt_logprob_ids.add(new.req_id)
        if p is not None and (generator is not None or p.logit_bias or p.min_tokens or p.logprobs is not None):
            self.special_ids.add(new.req_id)
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt[row] = len(new.prompt_token_ids)
        self.num_computed[row] = new.num_computed_tokens
        self.lora_ids[row] = new.lora_id
        self.state_slots[row] = new.state_slot
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids, new.group_block_ids)
        if p is not None:  # (a pooling request samples nothing)
            self._set_sampling(row, p)

    def _update_all(self, cached: list[CachedRequestData]) -> None:
        """``update`` for each, with the usual decode step's deltas (one new token, no resume)
        written for all rows at once: a numpy call per field, not per request."""
        one_token = []
        for c in cached:
            if len(c.new_token_ids) == 1 and not c.resumed_from_preemption:
                one_token.append(c)
            else:
                self.update(c)
        if not one_token:
            return
        rows = self.rows([c.req_id for c in one_token])
        n = self.num_tokens[rows]
        self.token_ids[rows, n] = [c.new_token_ids[0] for c in one_token]
        self.num_tokens[rows] = n + 1
        self.num_computed[rows] = [c.num_computed_tokens for c in one_token]
        for row, c in zip(rows.tolist(), one_token):
            if c.new_block_ids or any(c.new_group_block_ids):
                self._append_blocks(row, c.new_block_ids, c.new_group_block_ids)

    def update(self, cached: CachedRequestData) -> None:
        row = self.index[cached.req_id]
        n, k = int(self.num_tokens[row]), len(cached.new_token_ids)
        self.token_ids[row, n : n + k] = cached.new_token_ids
        self.num_tokens[row] = n + k
        self.num_computed[row] = cached.num_computed_tokens
        if cached.resumed_from_preemption:
            self.num_blocks[row] = 0
            self.state_slots[row] = cached.state_slot
        self._append_blocks(row, cached.new_block_ids, cached.new_group_block_ids)

    def remove(self, req_id: str) -> None:
        row = self.index.pop(req_id, None)
        if row is not None:
            self.version += 1
            self.states.pop(req_id, None)
            self.prompt_logprob_ids.discard(req_id)
            self.special_ids.discard(req_id)
            self._free_rows.append(row)

    def _append_blocks(self, row: int, block_ids: list[int], group_block_ids: list[list[int]]) -> None:
        start, end = int(self.num_blocks[row]), int(self.num_blocks[row]) + len(block_ids)
        self.block_tables[0, row, start:end] = block_ids
        for group, ids in enumerate(group_block_ids, start=1):
            self.block_tables[group, row, start:end] = ids
        self.num_blocks[row] = end

    def _set_sampling(self, row: int, p: SamplingParams) -> None:
        self.temperature[row] = p.temperature
        self.greedy[row] = p.greedy
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty

    # -- views ------------------------------------------------------------------------------
    def rows(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter((self.index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    @property
    def block_table(self) -> np.ndarray:
        """Group 0's block tables [capacity, max_blocks] (every layer's, for most models)."""
        return self.block_tables[0]

    def block_ids(self, row: int, group: int = 0) -> np.ndarray:
        return self.block_tables[group, row, : self.num_blocks[row]]

    def padded_tokens(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> torch.Tensor:
        """token_ids[row, start:end] of each row, padded with -1 to the longest: [len(rows), width]."""
        width = max(1, int((end - start).max(initial=0)))
        cols = start[:, None] + np.arange(width)[None, :]
        valid = cols < end[:, None]
        values = self.token_ids[rows[:, None], np.minimum(cols, self.max_model_len - 1)]
        return torch.from_numpy(np.where(valid, values, -1))


# (array name, dtype, fill) of the per-row scalars
_ROW_FIELDS = (
    ("num_tokens", np.int64, 0),
    ("num_prompt", np.int64, 0),
    ("num_computed", np.int64, 0),
    ("num_blocks", np.int64, 0),
    ("lora_ids", np.int64, 0),  # the LoRA adapter each request runs under (0: the base model)
    ("state_slots", np.int64, -1),  # state-space models: each request's recurrent-state slot
    ("temperature", np.float32, 1.0),
    ("greedy", np.bool_, True),
    ("top_k", np.int64, 0),
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("presence", np.float32, 0.0),
    ("frequency", np.float32, 0.0),
    ("repetition", np.float32, 1.0),
)
