"""The KV cache manager's side of the tiers: keys of the blocks the radix tree holds, the blocks to
save when the tree lets them go (or, with a disk tier, as they are computed, or once they are used
again), and the blocks to load for a prefix the tree no longer has but a lower tier does.

The write policies are SGLang HiCache's. ``write_through`` writes every computed block to the tiers
below host memory as it is computed, so a restart (or a kill) finds everything. ``write_through_selective``
writes a block there only once it is used again (a prefix hit in the tree or in host memory): a
workload whose prompts never repeat writes nothing, and what persists is what was worth keeping.

The copies themselves are the driver worker's (``KVTierStore.apply``): the saves and loads ride to
it on the step's ``SchedulerOutput`` (``kv_saves``, ``kv_loads``) and run before the forward pass,
so a block let go in this step is copied out before anything overwrites it, and a block loaded is
in place before anything reads it.
"""

from __future__ import annotations

from typing import Any

from pagoda.core.kv_tiers.block_hash import chain_root, extend_chain
from pagoda.core.kv_tiers.store import KVTierStore
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.request import Request


Save = tuple[int, bytes, bool, bool]  # (block, key, kept in host memory, written to the tiers below)


class KVTierLink:
    def __init__(self, store: KVTierStore, identity: bytes, block_size: int,
                 write_policy: str = "write_through") -> None:
        self.store = store
        self.identity = identity
        self.block_size = block_size
        # with host memory alone a block goes down only when the tree lets it go
        self.write_through = store.lower is not None and write_policy == "write_through"
        self.write_reused = store.lower is not None and write_policy == "write_through_selective"
        # write_through_selective: keys of the tree's blocks already asked to be written (left on eviction)
        self._sent_down: set[bytes] = set()
        self._roots: dict[Any, bytes] = {}
        self._chains: dict[str, list[bytes]] = {}  # request id → keys of its full blocks so far
        self.block_key: dict[int, bytes] = {}  # block in the radix tree → its key
        self.saves: list[Save] = []
        self.loads: list[tuple[bytes, int]] = []

    def chain(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first ``num_blocks`` full blocks (computed once a request)."""
        keys = self._chains.setdefault(request.request_id, [])
        if len(keys) < num_blocks:
            salt = request.prefix_key  # the tenant salt, and a LoRA adapter's files
            root = self._roots.get(salt)
            if root is None:
                root = self._roots[salt] = chain_root(self.identity, salt)
            extend_chain(keys, root, request.cache_token_ids, self.block_size, num_blocks)
        return keys if len(keys) == num_blocks else keys[:num_blocks]

    def prefetch(self, request: Request) -> None:
        """A request arrived: read ahead the run of its prompt's blocks that the tiers hold."""
        keys = self.chain(request, (request.num_prompt_tokens - 1) // self.block_size)
        n = 0
        while n < len(keys) and self.store.known(keys[n]):
            n += 1
        self.store.prefetch(keys[:n])

    def stored(self, request: Request, blocks: list[int], start: int, end: int) -> None:
        """The tree took the request's blocks ``start`` .. ``end`` - 1 (its own copies)."""
        keys = self.chain(request, end)
        for i in range(start, end):
            key = keys[i]
            self.block_key[blocks[i]] = key
            if self.write_through and not self.store.known(key):
                self.saves.append((blocks[i], key, False, True))

    def reused(self, blocks: list[int]) -> None:
        """A prefix hit on these blocks of the tree: under write_through_selective, they go down now."""
        if not self.write_reused:
            return
        for block in blocks:
            key = self.block_key.get(block)
            if key is not None and key not in self._sent_down:
                self._sent_down.add(key)
                self.saves.append((block, key, False, True))

    def promoted(self, keys: list[bytes], blocks: list[int]) -> None:
        """Blocks taken from the pool for keys ``pin_run`` pinned: load them, and know their keys."""
        self.loads += zip(keys, blocks)
        self.block_key.update(zip(blocks, keys))

    def evicted(self, blocks: list[int]) -> None:
        """The tree let these blocks go: they go down to host memory."""
        for block in blocks:
            key = self.block_key.pop(block, None)
            self._sent_down.discard(key)
            if key is not None and not self.store.in_memory(key):
                self.saves.append((block, key, True, not self.write_reused))

    def forget(self, request_id: str) -> None:
        self._chains.pop(request_id, None)

    def take_saves(self) -> list[Save]:
        """The pending saves, handed to the caller to run now (``engine/kv_offload.hand_off``)."""
        saves, self.saves = self.saves, []
        return saves

    def attach(self, out: SchedulerOutput) -> None:
        """Hand the pending copies to the step that runs (a step with nothing scheduled keeps them)."""
        out.kv_saves, out.kv_loads = self.saves, self.loads
        self.saves, self.loads = [], []
