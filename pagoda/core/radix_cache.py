"""A radix tree over full KV blocks, for sharing prompt prefixes between requests.

SGLang's RadixAttention, at block granularity: every edge of the tree is a run of whole blocks
(its token ids, a multiple of block_size long, and the KV block id of each block). A request
walks the tree with its tokens and reuses every block already computed for the same prefix;
finished and preempted requests insert their full blocks. Nodes in use by running requests are
locked (`lock_ref` counts them along the path to the root); unlocked nodes are evicted
leaf-first in least-recently-used order, only when the block pool runs out of free blocks.

Ownership: the tree holds one reference to each block it stores (BlockPool ref counts); a
request that reuses a block takes a reference of its own. Evicting a node drops the tree's
reference. Requests with different cache salts live under different roots and never share.

Models with several KV cache groups (core/kv_cache_groups.py: Gemma 3's local layers) store,
beside each block of the tree (group 0's), the same tokens' blocks of the other groups
(``extras``). Those are windowed layers' blocks: a running request lets go of them once its window
has passed, and a block only the tree still holds is then *evictable on its own*, even on a
locked path (least recently let go first, before any node is evicted); its entry becomes None.
A later request can use a cached prefix only up to a point whose last window of blocks is still
complete (KVCacheManager.match_prefix checks).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...] = ()
    blocks: list[int] = field(default_factory=list)
    parent: "RadixNode | None" = None
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)  # first block's tokens → child
    lock_ref: int = 0
    last_access: int = 0  # a logical clock: LRU order
    last_access_time: float = 0.0  # monotonic seconds, for the dashboard's age of a prefix

    def touch(self) -> None:
        self.last_access = next(_clock)
        self.last_access_time = time.monotonic()


@dataclass
class PrefixMatch:
    blocks: list[int]
    node: RadixNode  # deepest node of the match (lock it while the blocks are in use)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class RadixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._roots: dict[object, RadixNode] = {}
        self.num_cached_blocks = 0
        self.num_evictable_nodes_blocks = 0  # blocks in nodes with lock_ref == 0 (group 0's)
        # Several KV cache groups: group 0's block id → the other groups' blocks of the same
        # tokens (None: evicted); each such block → its group-0 block; the ones only the tree
        # holds, least recently let go first.
        self.extras: dict[int, list[int | None]] = {}
        self._extra_owner: dict[int, int] = {}
        self._evictable_extras: OrderedDict[int, None] = OrderedDict()

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks an eviction can give back: unlocked nodes' blocks and extras only the tree holds."""
        return self.num_evictable_nodes_blocks + len(self._evictable_extras)

    def _root(self, salt) -> RadixNode:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = RadixNode()
            root.lock_ref = 1  # roots are never evicted
        return root

    def _chunks(self, tokens: list[int] | tuple[int, ...]) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(tokens[i : i + bs]) for i in range(0, len(tokens) - len(tokens) % bs, bs)]

    # -- match ------------------------------------------------------------------------------
    def match(self, tokens: list[int], salt=None) -> PrefixMatch:
        """Longest cached run of whole blocks that prefixes `tokens` (splitting a node where the
        match ends inside it, so the returned node ends exactly at the match)."""
        node = self._root(salt)
        node.touch()
        return self._descend(node, self._chunks(tokens))

    def _descend(self, node: RadixNode, chunks: list[tuple[int, ...]]) -> PrefixMatch:
        """The longest run of ``chunks`` stored below ``node``, touching each node on it."""
        blocks: list[int] = []
        i = 0
        while i < len(chunks):
            child = node.children.get(chunks[i])
            if child is None:
                break
            child_chunks = self._chunks(child.tokens)
            n = 0
            while n < len(child_chunks) and i + n < len(chunks) and child_chunks[n] == chunks[i + n]:
                n += 1
            if n < len(child_chunks):
                child = self._split(child, n)
            blocks += child.blocks
            child.touch()
            node, i = child, i + n
        return PrefixMatch(blocks, node)

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut node after num_blocks blocks; returns the new upper part (node becomes its child)."""
        cut = num_blocks * self.block_size
        upper = RadixNode(node.tokens[:cut], node.blocks[:num_blocks], node.parent, {}, node.lock_ref, node.last_access,
                           node.last_access_time)
        node.parent.children[upper.tokens[: self.block_size]] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[num_blocks:], upper
        upper.children[node.tokens[: self.block_size]] = node
        return upper

    # -- locking ----------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.num_evictable_nodes_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_nodes_blocks += len(node.blocks)
            node = node.parent

    # -- insert -----------------------------------------------------------------------------
    def insert(self, tokens: list[int], blocks: list[int], salt=None,
               extras: list[list[int | None]] | None = None) -> tuple[int, RadixNode]:
        """Store the full blocks of `tokens` (block i holds tokens[i*bs:(i+1)*bs]), and with
        several KV cache groups ``extras[i]``, block i's blocks of the other groups.

        Returns (how many leading blocks were cached already, under these or other block ids;
        the node where the inserted run ends). The tree keeps a reference of its own to every
        block it stores from the first return value on (extras too, but not None): the caller
        must add it (incref).
        """
        chunks = self._chunks(tokens)[: len(blocks)]
        blocks = blocks[: len(chunks)]
        match = self.match([t for c in chunks for t in c], salt)
        return self._store_rest(match, chunks, blocks, extras)

    def extend(self, node: RadixNode, num_blocks: int, tokens: list[int], blocks: list[int],
               extras: list[list[int | None]] | None = None) -> tuple[int, RadixNode]:
        """``insert`` for a run whose first ``num_blocks`` blocks the tree holds up to ``node``
        (a node that a running request keeps locked: not evicted, and a split leaves it ending
        where it did). Walks only the new blocks, where ``insert`` rebuilds and matches the whole
        run from the root: a running request's blocks are stored as they fill, one every
        block_size tokens, so at 64 streams that walk ran ~4 times a step. The path above
        ``node`` is touched as ``insert``'s match would have."""
        path = []
        up = node
        while up is not None:
            path.append(up)
            up = up.parent
        for up in reversed(path):
            up.touch()
        bs = self.block_size
        chunks = self._chunks(tokens[num_blocks * bs : len(blocks) * bs])
        match = self._descend(node, chunks)
        have, end = self._store_rest(match, chunks, blocks[num_blocks : num_blocks + len(chunks)],
                                     extras[num_blocks:] if extras is not None else None)
        return num_blocks + have, end

    def _store_rest(self, match: PrefixMatch, chunks: list[tuple[int, ...]], blocks: list[int],
                    extras: list[list[int | None]] | None) -> tuple[int, RadixNode]:
        """Store the chunks past ``match`` (its blocks are the first ones) in one new node."""
        have = match.num_blocks
        node = match.node
        if have < len(chunks):
            new_tokens = tuple(t for c in chunks[have:] for t in c)
            node = RadixNode(new_tokens, list(blocks[have:]), match.node)
            node.touch()
            match.node.children[chunks[have]] = node
            self.num_cached_blocks += len(node.blocks)
            self.num_evictable_nodes_blocks += len(node.blocks)
            if extras is not None:
                for block, extra in zip(node.blocks, extras[have:]):
                    self.extras[block] = list(extra)
                    self._extra_owner.update((b, block) for b in extra if b is not None)
        return have, node

    def relock(self, old: RadixNode, new: RadixNode) -> None:
        """``lock(new)`` then ``unlock(old)`` where ``old`` is ``new`` or above it on its path:
        only the nodes between them change."""
        node = new
        while node is not old:
            if node.lock_ref == 0:
                self.num_evictable_nodes_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    # -- the other KV cache groups' blocks ---------------------------------------------------
    def holds_extra(self, block: int) -> bool:
        return block in self._extra_owner

    def extra_released(self, block: int) -> None:
        """Only the tree holds this extra block now: it may be evicted."""
        self._evictable_extras[block] = None

    def extra_taken(self, block: int) -> None:
        """A request holds this extra block again."""
        self._evictable_extras.pop(block, None)

    def _forget_extra(self, block: int) -> None:
        owner = self.extras[self._extra_owner.pop(block)]
        owner[owner.index(block)] = None
        self._evictable_extras.pop(block, None)

    # -- evict ------------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> list[int]:
        """Release at least num_blocks blocks (the tree's references; fewer when nothing more is
        evictable): first extras only the tree holds, least recently let go first, then
        least-recently-used unlocked leaves (with their extras)."""
        released: list[int] = []
        while self._evictable_extras and len(released) < num_blocks:
            block = next(iter(self._evictable_extras))
            self._forget_extra(block)
            released.append(block)
        if len(released) >= num_blocks:
            return released
        leaves = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(leaves)
        while leaves and len(released) < num_blocks:
            _, _, node = heapq.heappop(leaves)
            released += node.blocks
            for block in node.blocks:
                for extra in self.extras.pop(block, ()):
                    if extra is not None:
                        del self._extra_owner[extra]
                        self._evictable_extras.pop(extra, None)
                        released.append(extra)
            self.num_cached_blocks -= len(node.blocks)
            self.num_evictable_nodes_blocks -= len(node.blocks)
            parent = node.parent
            del parent.children[node.tokens[: self.block_size]]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return released

    def _leaves(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None:
                yield node

    def reset(self) -> list[int]:
        """Forget everything unlocked (returns the released blocks)."""
        return self.evict(self.num_cached_blocks + len(self._extra_owner))
