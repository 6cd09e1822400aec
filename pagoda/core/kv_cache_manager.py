"""Allocates KV slots for requests; the scheduler sees only "can this request grow by n tokens?"."""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool
from pagoda.core.radix_cache import RadixCache, RadixNode
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Blocks for requests, with optional prefix sharing through a radix tree.

    With prefix caching, a fresh request first reuses every cached full block of its prompt
    (`match_prefix`); blocks it frees (finished or preempted) go into the tree instead of the
    free list, and cached blocks nobody uses are evicted, LRU leaf first, only when an
    allocation finds the free list short.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(block_size) if enable_prefix_caching else None
        self._locked: dict[str, RadixNode] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones nobody is using."""
        return self.pool.num_free_blocks + self.num_evictable_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self.cache.num_evictable_blocks if self.cache else 0

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached blocks nobody uses count as free)."""
        return (self.pool.num_used_blocks - self.num_evictable_blocks) / self.pool.num_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(request.block_ids))

    def match_prefix(self, request: Request) -> int:
        """Give a request with nothing computed the cached blocks of its prefix; returns the
        number of tokens it no longer has to compute. At least one token is left to compute."""
        if self.cache is None or request.block_ids or request.num_computed_tokens:
            return 0
        match = self.cache.match(request.all_token_ids[: request.num_tokens - 1], request.cache_salt)
        self.prefix_query_tokens += request.num_tokens
        if match.blocks:
            self.pool.incref(match.blocks)
            self.cache.lock(match.node)
            self._locked[request.request_id] = match.node
            request.block_ids = list(match.blocks)
            request.num_computed_tokens = len(match.blocks) * self.block_size
            self.prefix_hit_tokens += request.num_computed_tokens
        return request.num_computed_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold num_new_tokens more tokens.

        Returns False (and changes nothing) when there are not enough free blocks, even after
        evicting unused cached ones.
        """
        need = self.blocks_needed(request, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        short = need - self.pool.num_free_blocks
        if short > 0:
            self.pool.free(self.cache.evict(short))
        if need:
            request.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished, aborted or preempted). With prefix caching,
        its fully computed blocks stay in the tree for later requests."""
        blocks = request.block_ids
        drop = blocks
        if self.cache is not None and blocks:
            full = min(len(blocks), request.num_computed_tokens // self.block_size)
            tokens = request.all_token_ids[: full * self.block_size]
            already = self.cache.insert(tokens, blocks[:full], request.cache_salt)
            drop = blocks[:already] + blocks[full:]
        node = self._locked.pop(request.request_id, None)
        if node is not None:
            self.cache.unlock(node)
        if drop:
            self.pool.free(drop)
        request.block_ids = []

    def reset_prefix_cache(self) -> None:
        if self.cache is not None:
            self.pool.free(self.cache.reset())
