"""What each step tells the workers (pagoda/core/worker_deltas.py): a request whole once, then
its new tokens and blocks; after preemption its whole table again; a finished id once."""

from __future__ import annotations

from pagoda.core.worker_deltas import WorkerDeltas
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


def test_new_then_deltas_then_resumed_then_finished():
    deltas = WorkerDeltas()
    request = Request("r", [1, 2, 3], SamplingParams())
    request.block_ids = [7]
    first = deltas.message([(request, 3)], [], {})
    assert [n.req_id for n in first.new_requests] == ["r"] and not first.cached_requests
    assert first.new_requests[0].block_ids == [7] and first.num_scheduled_tokens == {"r": 3}

    request.num_computed_tokens = 3
    request.append_output_token(9)
    request.block_ids.append(8)
    second = deltas.message([(request, 1)], [], {})
    (cached,) = second.cached_requests
    assert (cached.new_token_ids, cached.new_block_ids, cached.resumed_from_preemption) == ([9], [8], False)

    deltas.preempted("r")
    request.block_ids = [4, 5]
    third = deltas.message([(request, 4)], ["r"], {})
    (cached,) = third.cached_requests
    assert cached.resumed_from_preemption and cached.new_block_ids == [4, 5]  # the whole new table

    deltas.finished("r")
    assert deltas.message([], [], {}).finished_req_ids == {"r"}
    assert deltas.message([], [], {}).finished_req_ids == set()  # once
