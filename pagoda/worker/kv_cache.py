"""Sizes the paged KV cache from a memory budget and allocates it once, for every layer."""

from __future__ import annotations

import math
import mmap

import torch

GiB = 1 << 30
DEFAULT_KV_CACHE_GIB = 2.0  # the CPU cache budget without --kv-cache-memory (at most half of what is available)

# Caches that store each (token, head) row of K or V as narrow codes and one float scale (the
# row's largest magnitude over the code's largest value): int8 as llama.cpp's q8_0 with a row for
# a block; fp8 (e4m3, e5m2) as vLLM's fp8 caches, with a scale per row instead of per tensor, so
# no calibration is needed and a row of small values keeps its precision.
SCALED_KV_DTYPES: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def bytes_per_block(num_slots: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """A block's K and V for ``num_slots`` layers (every layer, or a KV cache group's slots:
    core/kv_cache_groups.py)."""
    element = torch.empty((), dtype=dtype).element_size()
    scale = 4 if dtype in SCALED_KV_DTYPES else 0  # a float scale per token and head
    return 2 * num_slots * block_size * num_kv_heads * (head_dim * element + scale)


def cpu_budget_gib(requested_gib: float | None, available_bytes: int) -> float:
    """The CPU cache's budget: ``--kv-cache-memory``, else 2 GiB but never more than half of what
    the machine has available (the worker allocates it; the model pool counts it)."""
    return requested_gib if requested_gib is not None else min(DEFAULT_KV_CACHE_GIB, available_bytes / 2 / GiB)


def num_blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return int(budget_bytes // per_block)


def allocate_kv_cache(
    num_slots: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """One zeroed tensor [2, slots, blocks, kv_heads, block_size, head_dim]: a slot per layer, or
    per layer of a KV cache group (a hybrid model's layers share slots across groups).

    Within a block, each kv head's tokens are contiguous (block_size x head_dim), so attention
    over a block reads one contiguous run per head.

    Zeroed, not empty: masked-out slots still flow through the attention matmul (weight 0), and
    0 × NaN garbage would poison it. On CPU the zeros are the kernel's (``zeroed``).
    """
    return zeroed((2, num_slots, num_blocks, num_kv_heads, block_size, head_dim), dtype, device)


def allocate_kv_scales(num_slots: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """An int8 or fp8 cache's scales, [2, slots, blocks, kv_heads, block_size] float32 (one per
    token and head, for K and V); None for a float cache."""
    if dtype not in SCALED_KV_DTYPES:
        return None
    return zeroed((2, num_slots, num_blocks, num_kv_heads, block_size), torch.float32, device)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU it lies in an anonymous memory map, whose pages the kernel hands out
    zeroed on first write: a 2 GiB cache starts at once (``torch.zeros`` wrote every page, a
    noticeable part of each start: benchmarks/README.md, "Start-up time") and holds resident
    memory only for the blocks used so far, as vLLM's CPU cache (``torch.empty``) does. The map is
    unmapped with the tensor's last reference. /proc/PID/smaps shows it as `/dev/zero (deleted)`:
    the soak counts its pages apart (pagoda/bench/soak.py kv_cache_rss_bytes), as growth that is
    no leak."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
