"""Sizes the paged KV cache from a memory budget and allocates it once, for every layer."""

from __future__ import annotations

import torch

GiB = 1 << 30


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return int(budget_bytes // per_block)


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """One zeroed tensor [2, layers, blocks, kv_heads, block_size, head_dim].

    Within a block, each kv head's tokens are contiguous (block_size x head_dim), so attention
    over a block reads one contiguous run per head.

    Zeroed, not empty: masked-out slots still flow through the attention matmul (weight 0), and
    0 × NaN garbage would poison it.
    """
    return torch.zeros(2, num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
