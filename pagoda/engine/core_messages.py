"""The messages between the front end (LLMEngine, AsyncLLM) and the EngineCore's loop, on a thread
or in a process of its own (core_client.py): one dataclass per kind, so a loop matches on the type
and a process pickles plain data.

The front end sends ``EngineCoreRequest``s (request.py), what a request is before the core
schedules it (as vLLM's EngineCoreRequest); the core makes its own ``Request`` of each, which
only the scheduler writes from then on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.core.scheduler_stats import SchedulerStats
from pagoda.request import EngineCoreRequest, RequestStatus


# -- to the core ----------------------------------------------------------------------------------
@dataclass
class AddRequests:
    requests: list[EngineCoreRequest]


@dataclass
class FinishRequests:
    """Finish from outside a step: an abort, or a stop string the detokenizer saw."""

    request_ids: list[str]
    status: RequestStatus


@dataclass
class ReleaseSessions:
    """Sessions that ended: their pinned prefixes become ordinary cache."""

    session_ids: list[str]


@dataclass
class DebugQuery:
    """A recorder snapshot (engine/step_trace.py) wanted; answered with a ``DebugAnswer``."""

    query_id: int
    what: str
    limit: int | None = None


@dataclass
class Shutdown:
    """Leave the loop."""


ToCore = AddRequests | FinishRequests | ReleaseSessions | DebugQuery | Shutdown


# -- from an engine process -----------------------------------------------------------------------
@dataclass
class EngineReady:
    limits: Any  # the core's RequestLimits (engine/core.py), which the front end checks prompts against
    stats: SchedulerStats


@dataclass
class StepOutputs:
    outputs: list  # EngineCoreOutput, empty when orders left the core idle (its stats still changed)
    stats: SchedulerStats


@dataclass
class DebugAnswer:
    query_id: int
    snapshot: dict | None
    error: str | None  # the error's text when the snapshot failed


@dataclass
class EngineFailed:
    error: str


@dataclass
class EngineStopped:
    pass


FromCore = EngineReady | StepOutputs | DebugAnswer | EngineFailed | EngineStopped
