"""Allocates KV slots for requests; the scheduler sees only "can this request grow by n tokens?"."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.core.block_pool import BlockPool
from pagoda.core.kv_cache_groups import KVCacheGroups
from pagoda.core.kv_events import KVEventLog
from pagoda.core.kv_tiers.link import KVTierLink
from pagoda.core.radix_cache import RadixCache, RadixNode
from pagoda.core.session_pins import SessionPins
from pagoda.core.state_snapshots import StateSnapshots
from pagoda.request import Request


# The block id a group table holds where its blocks were never taken (before a prefix hit's last
# window): any valid id, since no attention path reads a windowed layer's blocks before its window.
UNREAD_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVBlocks:
    """Blocks the manager hands a request: ids for group 0 (every full-attention layer) and for
    groups 1.. (hybrid models' windowed layers). The scheduler adds them to the request's block
    tables; the manager never writes a request."""

    ids: list[int]
    groups: list[list[int]]


class KVCacheManager:
    """Blocks for requests, with optional prefix sharing through a radix tree.

    With prefix caching, a fresh request first reuses every cached full block of its prompt
    (`match_prefix`); every full block it computes goes into the tree as soon as the step that
    computed it ends (`cache_computed_blocks`), with a reference of the tree's own, so its blocks
    outlive it; cached blocks nobody uses are evicted, LRU leaf first, only when an allocation
    finds the free list short.

    A finished request of a session (`Request.session_id`) leaves its computed prefix pinned
    for the session's next turn (core/session_pins.py), within a per-session and an overall
    budget (`session_max_blocks`, `session_total_blocks`); pins yield to allocations before
    any running request is preempted.

    With several KV cache groups (``kv_groups``, core/kv_cache_groups.py: Gemma 3), a request has
    a block table per group, all as long as ``block_ids`` (group 0's, the global layers'); the
    others (``Request.group_block_ids``) belong to windowed layers, and a block of theirs that lies
    wholly before the request's window is let go after each step (``release_out_of_window``),
    prefix caching or not. Its id stays in the table (never read again: every attention path
    starts at the window) and ``free`` skips it. The prefix tree keeps such blocks beside group
    0's as long as nothing needs the room (radix_cache.py), and a prefix hit is cut back to where
    the last window's blocks are all still there; before that window the tables hold
    ``UNREAD_BLOCK``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 session_max_blocks: int | None = None, session_total_blocks: int | None = None,
                 sliding_window: int | None = None, kv_groups: KVCacheGroups | None = None) -> None:
        """``sliding_window``: the model's window when *every* layer has one (Mistral-style); a
        running request's blocks that lie wholly before its window are then released
        (``release_out_of_window``), but only without prefix caching, which keeps whole prefixes.
        ``kv_groups``: several groups (a hybrid model) give each request a block table per group."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(block_size) if enable_prefix_caching else None
        self.sliding_window = sliding_window if self.cache is None else None
        self.num_groups = kv_groups.num_groups if kv_groups is not None else 1
        self.local_window = kv_groups.local_window if self.num_groups > 1 else None
        self._released_local: dict[str, int] = {}  # request id → its leading blocks let go in groups 1..
        self._released: dict[str, int] = {}  # request id → its leading blocks released (out of the window)
        self.num_released_blocks = 0  # counted over the engine's life
        self.sessions = SessionPins(self.cache, num_blocks if session_max_blocks is None else session_max_blocks,
                                    num_blocks // 2 if session_total_blocks is None else session_total_blocks) \
            if self.cache is not None else None
        self._locked: dict[str, RadixNode] = {}  # request id → deepest locked node of its path
        self._num_cached: dict[str, int] = {}  # request id → its leading blocks already in the tree
        # Counted once per admission (`record_prefix_query`), vLLM's split: fresh requests here,
        # requests resumed after a preemption in the preempted_* pair.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_preempted_query_tokens = 0
        self.prefix_preempted_hit_tokens = 0
        self.tiers: KVTierLink | None = None  # host memory and disk under the tree (attach_tiers)
        self.events: KVEventLog | None = None  # the tree's stored / removed blocks (--kv-events-config)
        # a state-space model's states after cached prefixes: a hit must end where one is kept
        self.snapshots: StateSnapshots | None = None

    def attach_tiers(self, link: KVTierLink) -> None:
        """Put the lower tiers (core/kv_tiers) under the prefix tree: blocks it lets go go down,
        and a prefix found below is promoted back at admission."""
        if self.cache is None or self.num_groups > 1:
            raise ValueError("kv_offload needs prefix caching and a model with one KV cache group")
        self.tiers = link

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
        """Pool blocks the request takes to grow by ``num_new_tokens`` (one per group per block)."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(request.block_ids)) * self.num_groups

    def has_room(self, request: Request, num_new_tokens: int) -> bool:
        """Its blocks already hold ``num_new_tokens`` more tokens (``blocks_needed`` is 0)."""
        return request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Pool blocks that ``num_tokens`` tokens of a fresh request take."""
        return cdiv(num_tokens, self.block_size) * self.num_groups

    def match_prefix(self, request: Request) -> KVBlocks | None:
        """The cached blocks of the prefix of a request with nothing computed (None: no hit); its
        tokens in those blocks need no computing. At least one token is left to compute.

        Counts nothing: a request that cannot be admitted gives the match back (`free`) and is
        matched again next step, so the scheduler counts it with `record_prefix_query` once it
        is admitted."""
        if request.block_ids or request.num_computed_tokens or not self._uses_prefix_cache(request):
            return None
        tokens = request.cache_token_ids[: request.num_tokens - 1]
        if self.tiers is not None:
            self._promote(request, tokens)
        match = self.cache.match(tokens, request.prefix_key)
        usable = len(match.blocks)  # cut where every group's blocks, and a state-space model's state, are kept
        if self.num_groups > 1 and usable:
            usable = self._usable_hit(match.blocks)
        if self.snapshots is not None and usable:
            usable = self.snapshots.usable_blocks(tokens, request.prefix_key, usable)
        if usable < len(match.blocks):
            match = self.cache.match(tokens[: usable * self.block_size], request.prefix_key)
        if not match.blocks:
            return None
        if self.tiers is not None:
            self.tiers.reused(match.blocks)
        self.pool.incref(match.blocks)
        self._lock(request, match.node)
        self._num_cached[request.request_id] = len(match.blocks)
        groups = self._take_cached_extras(request, match.blocks) if self.num_groups > 1 else []
        return KVBlocks(list(match.blocks), groups)

    def _promote(self, request: Request, tokens: list[int]) -> None:
        """Bring back from the lower tiers the blocks of the prompt's prefix that follow what the
        tree holds: pool blocks for them go into the tree (the tree's reference), to be loaded
        before the step's forward pass, and the match that follows finds them. Leaves room for the
        rest of the prompt."""
        bs = self.block_size
        match = self.cache.match(tokens, request.prefix_key)
        full = len(tokens) // bs
        if match.num_blocks >= full:
            return
        keys = self.tiers.chain(request, full)[match.num_blocks:]
        self.cache.lock(match.node)  # evicting for room must not take the prefix it extends
        try:
            room = self.num_free_blocks - self.blocks_for_tokens(request.num_tokens - full * bs)
            run = self.tiers.store.pin_run(keys[:max(0, room)])
            if run == 0:
                return
            self._evict(run - self.pool.num_free_blocks)
            blocks = self.pool.allocate(run)
            self.cache.insert(tokens[:(match.num_blocks + run) * bs], match.blocks + blocks, request.prefix_key)
            self.tiers.promoted(keys[:run], blocks)
            if self.events is not None:
                self.events.stored(request, match.blocks + blocks, match.num_blocks, match.num_blocks + run)
        finally:
            self.cache.unlock(match.node)

    def _evict(self, num_blocks: int) -> None:
        """Evict ``num_blocks`` blocks (if > 0) from the tree back to the pool; with tiers, they go down."""
        if num_blocks > 0:
            released = self.cache.evict(num_blocks)
            if self.tiers is not None:
                self.tiers.evicted(released)
            if self.events is not None:
                self.events.removed(released)
            self.pool.free(released)

    def _first_in_window(self, num_tokens: int, window: int | None = None) -> int:
        """The first block a query at position ``num_tokens`` (or later) reads in a layer with a
        sliding ``window`` (default: the windowed groups')."""
        window = self.local_window if window is None else window
        return max(0, num_tokens - window + 1) // self.block_size

    def _usable_hit(self, blocks: list[int]) -> int:
        """How many of the matched blocks a request can start after: the most whose last window
        has every group's blocks still cached."""
        missing = [0]
        for block in blocks:
            missing.append(missing[-1] + (None in self.cache.extras.get(block, (None,))))
        for n in range(len(blocks), 0, -1):
            if missing[n] == missing[self._first_in_window(n * self.block_size)]:
                return n
        return 0

    def _take_cached_extras(self, request: Request, blocks: list[int]) -> list[list[int]]:
        """Group tables for a prefix hit: the cached blocks of the last window, ``UNREAD_BLOCK`` before."""
        first = self._first_in_window(len(blocks) * self.block_size)
        extras = [self.cache.extras[b] for b in blocks[first:]]
        groups = [[UNREAD_BLOCK] * first + [e[g] for e in extras] for g in range(self.num_groups - 1)]
        held = [b for ids in groups for b in ids[first:]]
        self.pool.incref(held)
        for b in held:
            self.cache.extra_taken(b)
        self._released_local[request.request_id] = first
        return groups

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup: its tokens as queries, `num_hit_tokens` (what
        `match_prefix` gave it) as hits. As in vLLM, a request resumed after a preemption
        (recomputing prompt + output) counts in the preempted_* pair instead, so the main pair
        is exactly the prompt tokens of the requests admitted, each once. Requests that skip
        the cache (prompt logprobs still owed) count nowhere."""
        if not self._uses_prefix_cache(request):
            return
        if request.num_preemptions:
            self.prefix_preempted_query_tokens += request.num_tokens
            self.prefix_preempted_hit_tokens += num_hit_tokens
        else:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += num_hit_tokens

    def _uses_prefix_cache(self, request: Request) -> bool:
        return self.cache is not None and not self._needs_prompt_logprobs(request)

    @staticmethod
    def _needs_prompt_logprobs(request: Request) -> bool:
        """Prompt logprobs come from computing the prompt, so a request that still owes some
        skips the cache (as in vLLM); once they are all reported (a preempted request), it may hit."""
        wanted = request.sampling_params.prompt_logprobs is not None
        return wanted and request.num_prompt_logprobs_done < request.num_prompt_tokens - 1

    def allocate_slots(self, request: Request, num_new_tokens: int) -> KVBlocks | None:
        """The blocks the request's tables need to hold num_new_tokens more tokens (none, most
        decode steps: the last block has room), taken from the pool for it.

        None (and nothing taken) when there are not enough free blocks, even after evicting
        unused cached ones.
        """
        need = self.blocks_needed(request, num_new_tokens)
        if need == 0:
            return KVBlocks([], [])
        if need > self.num_free_blocks and self.sessions:
            self.sessions.release_for(need, lambda: self.num_free_blocks)
        if need > self.num_free_blocks:
            return None
        self._evict(need - self.pool.num_free_blocks)
        per_group = need // self.num_groups
        ids = self.pool.allocate(per_group)
        return KVBlocks(ids, [self.pool.allocate(per_group) for _ in range(self.num_groups - 1)])

    def cache_computed_blocks(self, request: Request) -> None:
        """Put the request's newly completed full blocks in the tree right away, so requests
        arriving meanwhile (the same system prompt, in the same burst) share them, and lock
        the request's path so nothing it uses can be evicted."""
        if self.cache is None:
            return
        full = min(len(request.block_ids), request.num_computed_tokens // self.block_size)
        done = self._num_cached.get(request.request_id, 0)
        if full <= done:
            return
        tokens = request.cache_token_ids[: full * self.block_size]
        extras = self._group_blocks(request, full) if self.num_groups > 1 else None
        locked = self._locked.get(request.request_id)
        if locked is not None:  # its first `done` blocks are stored up to the node it holds
            have, node = self.cache.extend(locked, done, tokens, request.block_ids[:full], extras)
        else:
            have, node = self.cache.insert(tokens, request.block_ids[:full], request.prefix_key, extras)
        if have < full:
            self.pool.incref(request.block_ids[have:full])  # the tree's own reference
            if self.tiers is not None:
                self.tiers.stored(request, request.block_ids, have, full)
            if self.events is not None:
                self.events.stored(request, request.block_ids, have, full)
            if extras is not None:
                self.pool.incref([b for extra in extras[have:] for b in extra if b is not None])
        self._lock(request, node)
        self._num_cached[request.request_id] = full

    def _group_blocks(self, request: Request, num_blocks: int) -> list[list[int | None]]:
        """Each of the first ``num_blocks`` blocks' blocks in groups 1.. (None where let go)."""
        released = self._released_local.get(request.request_id, 0)
        return [[ids[i] if i >= released else None for ids in request.group_block_ids] for i in range(num_blocks)]

    @property
    def releases_out_of_window(self) -> bool:
        """Whether ``release_out_of_window`` can ever let a block go (a window, on every layer
        or on a group's)."""
        return self.sliding_window is not None or self.local_window is not None

    def release_out_of_window(self, request: Request) -> int:
        """After a step: give back the request's blocks no query of its can see again (see
        ``_release_group_blocks`` and ``_release_every_layer``); returns how many it let go now."""
        if self.local_window is not None:
            return self._release_group_blocks(request)
        return self._release_every_layer(request)

    def _release_group_blocks(self, request: Request) -> int:
        """Let go of the request's blocks in groups 1.. (windowed layers) that its window has passed."""
        dead = min(len(request.block_ids), self._first_in_window(request.num_computed_tokens))
        done = self._released_local.get(request.request_id, 0)
        if dead <= done:
            return 0
        for ids in request.group_block_ids:
            self._let_go(ids[done:dead])
        self._released_local[request.request_id] = dead
        self.num_released_blocks += (dead - done) * (self.num_groups - 1)
        return (dead - done) * (self.num_groups - 1)

    def _let_go(self, blocks: list[int]) -> None:
        """Drop the request's reference to blocks of groups 1..; one the tree still holds becomes evictable."""
        self.pool.free(blocks)
        if self.cache is not None:
            for b in blocks:
                if self.cache.holds_extra(b) and self.pool.ref_count(b) == 1:
                    self.cache.extra_released(b)

    def _release_every_layer(self, request: Request) -> int:
        """Drop the request's blocks that no query of its can see again: with every layer windowed,
        a query at position p >= num_computed_tokens sees keys from p - window + 1 on, so a block
        ending before num_computed_tokens - window + 1 is dead. Its id stays in ``block_ids`` (the
        block table keeps its shape; the attention paths never read blocks before a row's
        window) and returns to the pool; ``free`` skips it. Returns how many were released now."""
        if self.sliding_window is None:
            return 0
        dead = min(len(request.block_ids), self._first_in_window(request.num_computed_tokens, self.sliding_window))
        done = self._released.get(request.request_id, 0)
        if dead <= done:
            return 0
        self.pool.free(request.block_ids[done:dead])
        self._released[request.request_id] = dead
        self.num_released_blocks += dead - done
        return dead - done

    def _lock(self, request: Request, node: RadixNode) -> None:
        """Lock the request's path down to ``node``. The node a request holds only moves down its
        own path (its blocks are stored as they fill), so only the nodes between the old and the
        new one change."""
        old = self._locked.get(request.request_id)
        if old is None:
            self.cache.lock(node)
        else:
            self.cache.relock(old, node)
        self._locked[request.request_id] = node

    def free(self, request: Request, finished: bool = False) -> None:
        """Release the request's blocks (finished, aborted or preempted; the scheduler then clears
        the request's tables). Blocks in the prefix
        cache keep the tree's reference and stay there for later requests; a finished request
        of a session pins its computed prefix for the session's next turn."""
        if finished and request.session_id is not None and self.sessions is not None:
            full = min(len(request.block_ids), request.num_computed_tokens // self.block_size,
                       self._num_cached.get(request.request_id, 0))
            self.sessions.pin(request.session_id, request.cache_token_ids, full, request.prefix_key)
        if finished and self.tiers is not None:
            self.tiers.forget(request.request_id)
        node = self._locked.pop(request.request_id, None)
        if node is not None:
            self.cache.unlock(node)
        self._num_cached.pop(request.request_id, None)
        released = self._released.pop(request.request_id, 0)
        if len(request.block_ids) > released:
            self.pool.free(request.block_ids[released:])
        released = self._released_local.pop(request.request_id, 0)
        for ids in request.group_block_ids:
            self._let_go(ids[released:])

    def release_session(self, session_id: str) -> bool:
        """The session ended: its pinned prefix becomes ordinary cache (evictable)."""
        return self.sessions.release(session_id) if self.sessions is not None else False

    @property
    def num_session_pinned_blocks(self) -> int:
        return self.sessions.num_pinned_blocks if self.sessions is not None else 0

    def reset_prefix_cache(self) -> None:
        if self.snapshots is not None:
            self.snapshots.reset()
        if self.cache is not None:
            released = self.cache.reset()
            if self.tiers is not None:
                self.tiers.evicted(released)
            if self.events is not None:
                self.events.cleared()
            self.pool.free(released)
