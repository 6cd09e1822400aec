"""The scheduler's writes of a request's block tables: what ``KVCacheManager`` hands out
(allocations, a prefix hit) appended to ``Request.block_ids`` (and the other KV cache groups'
tables), and cleared once the manager has freed them. The scheduler is the only writer of a
``Request``; these are its three writes of the tables."""

from __future__ import annotations

from pagoda.core.kv_cache_manager import KVBlocks
from pagoda.request import Request


def add_blocks(request: Request, blocks: KVBlocks | None) -> bool:
    """Append what ``KVCacheManager.allocate_slots`` gave the request; False when it gave nothing
    (no room)."""
    if blocks is None:
        return False
    request.block_ids.extend(blocks.ids)
    if blocks.groups:
        if not request.group_block_ids:
            request.group_block_ids = [[] for _ in blocks.groups]
        for ids, new in zip(request.group_block_ids, blocks.groups):
            ids.extend(new)
    return True


def add_prefix(request: Request, hit: KVBlocks | None, block_size: int) -> int:
    """Give a request with nothing computed its cached prefix (``KVCacheManager.match_prefix``);
    returns the tokens it no longer computes."""
    if hit is None:
        return 0
    add_blocks(request, hit)
    request.num_computed_tokens = len(hit.ids) * block_size
    return request.num_computed_tokens


def clear_blocks(request: Request) -> None:
    """After ``KVCacheManager.free``: the request holds no blocks."""
    request.block_ids = []
    request.group_block_ids = []
