"""Allocates KV slots for requests; the scheduler sees only "can this request grow by n tokens?"."""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold num_new_tokens more tokens.

        Returns False (and changes nothing) when there are not enough free blocks.
        """
        need = self.blocks_needed(request, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            request.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Release every block the request holds (finished, aborted or preempted)."""
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
