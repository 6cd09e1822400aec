"""The order of the scheduler's queues. Under "priority", a request's *effective* priority is its
`priority` plus one level for every `aging_seconds` it has waited since arrival (the starvation
guard), then arrival breaks ties; under "fcfs", arrival alone."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from pagoda.engine_args import SCHEDULING_POLICIES, EngineArgs
from pagoda.request import Request

_ARRIVAL = operator.attrgetter("arrival_time", "arrival_seq")  # the fcfs order

# A request of this priority or below (its own, not aged) is background work, such as a Batch API
# line (entrypoints/openai/batch_lines.py): it takes no step in which another request prefills,
# so an interactive prompt's first token waits for no batch decode.
BACKGROUND_PRIORITY = -1000


def is_background(request: Request) -> bool:
    return request.priority <= BACKGROUND_PRIORITY


def background_yields(running: list[Request], waiting: list[Request]) -> bool:
    """Whether background requests sit this step out: some run, and a request that is not
    background work has a prompt to compute (running mid-prefill, or waiting). Without
    background work running (most steps), one cheap pass decides."""
    if not any(map(is_background, running)):
        return False

    def prefilling(r: Request) -> bool:
        return r.num_tokens - r.num_computed_tokens > 1 and not is_background(r)
    return any(map(prefilling, running)) or any(not is_background(r) for r in waiting)


class RequestOrder:
    def __init__(self, policy: str = EngineArgs.scheduling_policy, aging_seconds: float = EngineArgs.aging_seconds) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.policy, self.aging_seconds = policy, aging_seconds

    def priority(self, request: Request, now: float) -> int:
        """The effective priority at ``now`` (higher goes first)."""
        if self.policy == "fcfs":
            return 0  # everyone equal: arrival decides, and nobody outranks anybody
        if self.aging_seconds <= 0:
            return request.priority
        return request.priority + int(max(0.0, now - request.arrival_time) / self.aging_seconds)

    def key(self, now: float, requests: list[Request] | None = None) -> Callable[[Request], Any]:
        """The sort key at ``now``. Under fcfs, or among ``requests`` of one priority (aging
        adds the same function of age to each, so the oldest stays first), that is arrival
        order, compared without a Python call a request."""
        if self.policy == "fcfs" or (requests is not None and len({r.priority for r in requests}) <= 1):
            return _ARRIVAL
        return lambda r: (-self.priority(r, now), r.arrival_time, r.arrival_seq)
