"""Sizes the paged KV cache from a memory budget and allocates it once, for every layer."""

from __future__ import annotations

import torch

GiB = 1 << 30


def bytes_per_block(num_slots: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """A block's K and V for ``num_slots`` layers (every layer, or a KV cache group's slots:
    core/kv_cache_groups.py)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_slots * block_size * num_kv_heads * head_dim * element


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
    0 × NaN garbage would poison it.
    """
    return torch.zeros(2, num_slots, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
