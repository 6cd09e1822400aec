"""Which adapters the workers hold: loaded on a request's first step, kept while any request the
workers know uses them, the idle ones bounded by max_cpu_loras, a replaced version dropped once
idle; and at most max_loras distinct adapters in a batch."""

from __future__ import annotations

from pagoda.core.lora_residency import LoRAResidency
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.lora.request import LoRARequest
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


def _request(rid: str, lora: LoRARequest | None) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), lora_request=lora)


A1, B2, C3 = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1))


def test_max_loras_bounds_a_batch():
    residency = LoRAResidency(max_loras=2, max_cpu_loras=2)
    running = [_request("1", A1), _request("2", B2), _request("3", None)]
    assert residency.fits(_request("4", A1), running)  # an adapter already in the batch
    assert residency.fits(_request("5", None), running)  # the base model always fits
    assert not residency.fits(_request("6", C3), running)  # a third adapter waits
    assert residency.fits(_request("7", C3), running[1:])


def test_loads_once_keeps_in_use_and_bounds_idle():
    residency = LoRAResidency(max_loras=1, max_cpu_loras=1)
    out = SchedulerOutput()
    residency.sent(_request("1", A1), out)
    residency.sent(_request("2", A1), out)
    assert out.lora_loads == [A1]  # loaded once for both
    out = SchedulerOutput()
    residency.sent(_request("3", B2), out)
    assert out.lora_loads == [B2] and residency.take_unloads() == []  # a is in use: kept
    residency.finished("1")
    residency.finished("2")  # a idle, b in use: one idle adapter is within max_cpu_loras
    assert residency.take_unloads() == [] and residency.held_ids == [1, 2]
    residency.finished("3")  # two idle: the least recently used goes
    assert residency.take_unloads() == [1] and residency.held_ids == [2]


def test_a_replaced_version_goes_when_idle():
    residency = LoRAResidency(max_loras=2, max_cpu_loras=4)
    old, new = LoRARequest("a", 1, "/v1"), LoRARequest("a", 5, "/v2")
    residency.sent(_request("1", old), SchedulerOutput())
    residency.sent(_request("2", new), SchedulerOutput())
    assert residency.take_unloads() == []  # the old version still runs request 1
    residency.finished("1")
    assert residency.take_unloads() == [1] and residency.held_ids == [5]


def test_prefix_key_separates_adapters_and_versions():
    base, under_a = _request("1", None), _request("2", A1)
    assert base.prefix_key is None and under_a.prefix_key != base.prefix_key
    v1 = LoRARequest("a", 1, "/x", fingerprint="f1")
    v2 = LoRARequest("a", 2, "/x", fingerprint="f2")
    same_files = LoRARequest("a", 3, "/y", fingerprint="f1")
    keys = [_request(str(i), lora).prefix_key for i, lora in enumerate((v1, v2, same_files))]
    assert keys[0] != keys[1] and keys[0] == keys[2]  # the files decide, not the id
