"""Fixed-size KV blocks: a free list and reference counts.

A block holds `block_size` tokens of K and V for every layer. Blocks are identified by an
integer id that indexes the per-layer cache tensors. Reference counts let several requests
share a block (prefix caching builds on that); a block returns to the free list when its
count drops to zero.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_cnt = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref count 1 each). Raises if fewer than n are free."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_cnt[b] = 1
        return blocks

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} is not allocated")
            self._ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero become free."""
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]
