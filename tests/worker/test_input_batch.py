"""The worker's persistent batch (pagoda/worker/input_batch.py): the scheduler's deltas applied to
its rows, rows reused and grown, the one-token fast path equal to the general update."""

from __future__ import annotations

import numpy as np
import torch

from pagoda.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.worker.input_batch import InputBatch

BS = 4


def _new(rid: str, prompt: list[int], blocks: list[int], **params) -> NewRequestData:
    return NewRequestData(rid, prompt, SamplingParams(**params), blocks, 0)


def test_a_new_request_fills_its_row():
    batch = InputBatch(max_model_len=32, block_size=BS)
    batch.apply(SchedulerOutput(new_requests=[_new("a", [5, 6, 7, 8, 9], [3, 1], temperature=0.5, top_k=7, seed=11)]))
    row = batch.index["a"]
    assert batch.token_ids[row, :5].tolist() == [5, 6, 7, 8, 9]
    assert (batch.num_tokens[row], batch.num_prompt[row], batch.num_computed[row]) == (5, 5, 0)
    assert batch.block_ids(row).tolist() == [3, 1]
    assert batch.temperature[row] == np.float32(0.5) and batch.top_k[row] == 7 and not batch.greedy[row]
    assert "a" in batch.special_ids  # a seed: sampled row by row with its own generator
    expected = torch.Generator().manual_seed(11)
    assert torch.equal(torch.rand(3, generator=batch.states["a"].generator), torch.rand(3, generator=expected))


def test_the_one_token_path_matches_the_general_update():
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8], "c": [9]}
    fast, slow = InputBatch(32, BS), InputBatch(32, BS)
    for batch in (fast, slow):
        batch.apply(SchedulerOutput(new_requests=[_new(r, p, [i]) for i, (r, p) in enumerate(prompts.items())]))
    deltas = [CachedRequestData("a", [10], [], 3), CachedRequestData("b", [11], [7], 5),
              CachedRequestData("c", [12], [], 1)]
    fast.apply(SchedulerOutput(cached_requests=deltas))  # all three one-token decode deltas at once
    for delta in deltas:
        slow.update(delta)
    for name in ("token_ids", "num_tokens", "num_computed", "num_blocks", "block_tables"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.block_ids(fast.index["b"]).tolist() == [1, 7]


def test_a_resumed_request_gets_a_new_table():
    batch = InputBatch(32, BS)
    batch.apply(SchedulerOutput(new_requests=[_new("a", [1, 2, 3, 4, 5], [8, 9])]))
    batch.apply(SchedulerOutput(cached_requests=[CachedRequestData("a", [6], [2, 3], 0, resumed_from_preemption=True)]))
    row = batch.index["a"]
    assert batch.block_ids(row).tolist() == [2, 3] and batch.num_computed[row] == 0
    assert batch.token_ids[row, :6].tolist() == [1, 2, 3, 4, 5, 6]


def test_rows_are_reused_and_the_arrays_grow_keeping_what_they_hold():
    batch = InputBatch(16, BS, capacity=2)
    batch.apply(SchedulerOutput(new_requests=[_new(f"r{i}", [i + 1] * (i + 1), [i]) for i in range(5)]))
    assert batch.token_ids.shape[0] >= 5
    for i in range(5):
        row = batch.index[f"r{i}"]
        assert batch.token_ids[row, : i + 1].tolist() == [i + 1] * (i + 1) and batch.block_ids(row).tolist() == [i]
    version = batch.version
    batch.apply(SchedulerOutput(finished_req_ids={"r1"}))
    freed = batch.version
    assert freed == version + 1 and "r1" not in batch.index and "r1" not in batch.states
    capacity = batch.token_ids.shape[0]
    batch.apply(SchedulerOutput(new_requests=[_new("again", [42], [9])]))
    assert batch.token_ids.shape[0] == capacity  # the freed row, not a new one
    assert batch.token_ids[batch.index["again"], 0] == 42


def test_kv_cache_groups_get_a_table_each():
    batch = InputBatch(32, BS, num_kv_groups=3)
    batch.apply(SchedulerOutput(new_requests=[NewRequestData("a", [1] * 5, SamplingParams(), [4, 5], 0,
                                                             group_block_ids=[[6, 7], [8, 9]])]))
    batch.apply(SchedulerOutput(cached_requests=[CachedRequestData("a", [2, 3, 4, 5], [10], 5,
                                                                   new_group_block_ids=[[11], [12]])]))
    row = batch.index["a"]
    assert [batch.block_ids(row, g).tolist() for g in range(3)] == [[4, 5, 10], [6, 7, 11], [8, 9, 12]]


def test_drafts_ride_after_the_last_token_for_one_step():
    batch = InputBatch(32, BS)
    batch.apply(SchedulerOutput(new_requests=[_new("a", [1, 2, 3], [0])]))
    batch.apply(SchedulerOutput(scheduled_spec_tokens={"a": [7, 8]}))
    row = batch.index["a"]
    assert batch.token_ids[row, :5].tolist() == [1, 2, 3, 7, 8] and batch.num_tokens[row] == 3
    batch.apply(SchedulerOutput(cached_requests=[CachedRequestData("a", [7, 9], [], 3)]))  # one accepted, one of its own
    assert batch.token_ids[row, :5].tolist() == [1, 2, 3, 7, 9] and batch.num_tokens[row] == 5


def test_padded_tokens_pads_each_row_to_the_longest():
    batch = InputBatch(8, BS)
    batch.apply(SchedulerOutput(new_requests=[_new("a", [1, 2, 3], [0]), _new("b", [4, 5, 6, 7, 8], [1])]))
    rows = batch.rows(["a", "b"])
    out = batch.padded_tokens(rows, np.array([1, 0]), np.array([3, 5]))
    assert out.tolist() == [[2, 3, -1, -1, -1], [4, 5, 6, 7, 8]]
