"""The KV cache's storage (pagoda/worker/kv_cache.py): on CPU it is zero from the start, takes
resident memory only as blocks are written, gives it back when dropped, and a budget larger than the
machine's available memory is refused when the engine starts, not when the blocks fill."""

from __future__ import annotations

import gc

import pytest
import torch

from pagoda import LLM
from pagoda.platform import available_memory_bytes, resident_memory_bytes
from pagoda.worker.kv_cache import GiB, allocate_kv_cache, allocate_kv_scales, zeroed

MiB = 1 << 20
CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])
def test_zeroed_is_zero_writable_and_shaped(dtype):
    t = zeroed((2, 3, 5, 7), dtype, CPU)
    assert t.shape == (2, 3, 5, 7) and t.dtype == dtype and t.is_contiguous()
    assert not t.float().any()
    t[1, 2] = 1
    assert t.float().sum().item() == 35
    assert zeroed((0, 4), dtype, CPU).shape == (0, 4)


def test_cache_memory_is_taken_as_blocks_are_written_and_returned_when_dropped():
    gc.collect()
    before = resident_memory_bytes()
    cache = allocate_kv_cache(4, 2048, 16, 4, 64, torch.float32, CPU)  # 256 MiB
    scales = allocate_kv_scales(4, 2048, 16, 4, torch.int8, CPU)
    assert cache.numel() * 4 == 256 * MiB and not cache[:, :, -1].any()
    assert resident_memory_bytes() - before < 32 * MiB
    cache[:, :, :512] = 1.0  # a quarter of every layer's blocks: 64 MiB
    grown = resident_memory_bytes() - before
    assert 56 * MiB < grown < 112 * MiB, grown / MiB
    del cache, scales
    gc.collect()
    assert resident_memory_bytes() - before < 16 * MiB


def test_a_budget_beyond_available_memory_is_refused_at_start(tiny_llama):
    too_much = available_memory_bytes(CPU) / GiB * 2
    with pytest.raises(ValueError, match="more than this machine has available"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=too_much)
