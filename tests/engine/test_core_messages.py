"""The messages between a front end and the engine core's loop (pagoda/engine/core_messages.py),
through the loop both core clients run (core_client._serve_core) on a real core: every kind goes
through a process queue's pickling unchanged, and the loop acts on each in order."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

from pagoda.config import create_engine_config
from pagoda.engine.core import EngineCore, EngineCoreOutput, RequestLimits
from pagoda.engine.core_client import _serve_core
from pagoda.engine.core_messages import (
    AddRequests, DebugAnswer, DebugQuery, EngineFailed, EngineReady, EngineStopped, FinishRequests, ReleaseSessions,
    Shutdown, StepOutputs,
)
from pagoda.engine_args import EngineArgs
from pagoda.request import EngineCoreRequest, RequestStatus
from pagoda.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def core(tiny_llama) -> EngineCore:
    core = EngineCore(create_engine_config(EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)))
    yield core
    core.shutdown()


def _request(rid: str, max_tokens: int = 3) -> EngineCoreRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(rid, [5, 6, 7], params, session_id="s" if rid == "pinned" else None)


def test_every_message_crosses_a_process_queue_unchanged(core):
    stats = core.stats()
    messages = [AddRequests([_request("a")]), FinishRequests(["a"], RequestStatus.FINISHED_ABORTED),
                ReleaseSessions(["s"]), DebugQuery(3, "engine", 5), Shutdown(),
                EngineReady(RequestLimits(64, 384, 10), stats), StepOutputs([EngineCoreOutput("a", [9], "length")], stats),
                DebugAnswer(3, {"x": 1}, None), EngineFailed("boom"), EngineStopped()]
    channel = mp.get_context("spawn").Queue()
    for message in messages:
        channel.put(message)
    received = [channel.get(timeout=10) for _ in messages]
    assert received == messages


def test_the_loop_acts_on_each_order_in_turn(core):
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outputs: list[EngineCoreOutput] = []
    answers: list[tuple] = []
    for message in [AddRequests([_request("runs"), _request("aborted", 50), _request("pinned")]),
                    FinishRequests(["aborted"], RequestStatus.FINISHED_ABORTED),
                    DebugQuery(1, "engine"), DebugQuery(2, "no such view")]:
        inbox.put(message)

    def emit(outs: list[EngineCoreOutput]) -> None:
        outputs.extend(outs)
        if not core.has_unfinished_requests():
            inbox.put(ReleaseSessions(["s"]))
            inbox.put(Shutdown())

    _serve_core(core, inbox, emit, lambda: False, lambda *answer: answers.append(answer))
    finished = {o.request_id: o.finish_reason for o in outputs if o.finish_reason is not None}
    assert finished == {"runs": "length", "pinned": "length"}  # the aborted one never ran a step
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "runs") == 3
    (first_id, snapshot, none), (second_id, nothing, error) = answers
    assert (first_id, none, second_id, nothing) == (1, None, 2, None)
    # answered where the loop read the query, before the first step: two waiting, the aborted one gone
    assert snapshot["stats"]["num_waiting"] == 2 and "unknown debug view" in error
    assert core.stats().num_sessions_pinned == 0 and core.stats().kv_cache_usage == 0  # the session let go
