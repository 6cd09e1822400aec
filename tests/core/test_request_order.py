"""The queues' order (pagoda/core/request_order.py): priority with aging, or arrival alone."""

from __future__ import annotations

import pytest

from pagoda.core.request_order import RequestOrder
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


def _request(rid: str, priority: int, arrival: float) -> Request:
    return Request(rid, [1], SamplingParams(), priority=priority, arrival_time=arrival)


def test_priority_then_arrival_and_aging_lifts_the_old():
    old_low, new_high = _request("old", 0, 0.0), _request("new", 1, 25.0)
    order = RequestOrder("priority", aging_seconds=10.0)
    assert [r.request_id for r in sorted([old_low, new_high], key=order.key(26.0))] == ["old", "new"]  # 0+2 > 1
    assert [r.request_id for r in sorted([old_low, new_high], key=order.key(5.0))] == ["new", "old"]
    assert RequestOrder("priority", aging_seconds=0).priority(old_low, 1e6) == 0  # aging off


def test_fcfs_is_arrival_alone():
    early, late = _request("early", 0, 1.0), _request("late", 9, 2.0)
    order = RequestOrder("fcfs")
    assert sorted([late, early], key=order.key(3.0)) == [early, late]
    assert order.priority(late, 3.0) == 0


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        RequestOrder("lifo")
