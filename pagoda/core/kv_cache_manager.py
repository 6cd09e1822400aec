"""Allocates KV slots for requests; the scheduler sees only "can this request grow by n tokens?"."""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool
from pagoda.core.radix_cache import RadixCache, RadixNode
from pagoda.core.session_pins import SessionPins
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 session_max_blocks: int | None = None, session_total_blocks: int | None = None,
                 sliding_window: int | None = None) -> None:
        """``sliding_window``: the model's window when *every* layer has one (Mistral-style); a
        running request's blocks that lie wholly before its window are then released
        (``release_out_of_window``), but only without prefix caching, which keeps whole prefixes."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(block_size) if enable_prefix_caching else None
        self.sliding_window = sliding_window if self.cache is None else None
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
        number of tokens it no longer has to compute. At least one token is left to compute.

        Counts nothing: a request that cannot be admitted gives the match back (`free`) and is
        matched again next step, so the scheduler counts it with `record_prefix_query` once it
        is admitted."""
        if request.block_ids or request.num_computed_tokens or not self._uses_prefix_cache(request):
            return 0
        match = self.cache.match(request.all_token_ids[: request.num_tokens - 1], request.cache_salt)
        if match.blocks:
            self.pool.incref(match.blocks)
            self._lock(request, match.node)
            self._num_cached[request.request_id] = len(match.blocks)
            request.block_ids = list(match.blocks)
            request.num_computed_tokens = len(match.blocks) * self.block_size
        return request.num_computed_tokens

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

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold num_new_tokens more tokens.

        Returns False (and changes nothing) when there are not enough free blocks, even after
        evicting unused cached ones.
        """
        need = self.blocks_needed(request, num_new_tokens)
        if need > self.num_free_blocks and self.sessions:
            self.sessions.release_for(need, lambda: self.num_free_blocks)
        if need > self.num_free_blocks:
            return False
        short = need - self.pool.num_free_blocks
        if short > 0:
            self.pool.free(self.cache.evict(short))
        if need:
            request.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Put the request's newly completed full blocks in the tree right away, so requests
        arriving meanwhile (the same system prompt, in the same burst) share them, and lock
        the request's path so nothing it uses can be evicted."""
        if self.cache is None:
            return
        full = min(len(request.block_ids), request.num_computed_tokens // self.block_size)
        if full <= self._num_cached.get(request.request_id, 0):
            return
        tokens = request.all_token_ids[: full * self.block_size]
        have, node = self.cache.insert(tokens, request.block_ids[:full], request.cache_salt)
        if have < full:
            self.pool.incref(request.block_ids[have:full])  # the tree's own reference
        self._lock(request, node)
        self._num_cached[request.request_id] = full

    def release_out_of_window(self, request: Request) -> int:
        """Drop the request's blocks that no query of its can see again: with every layer windowed,
        a query at position p >= num_computed_tokens sees keys from p - window + 1 on, so a block
        ending before num_computed_tokens - window + 1 is dead. Its id stays in ``block_ids`` (the
        block table keeps its shape; the attention paths never read blocks before a row's
        window) and returns to the pool; ``free`` skips it. Returns how many were released now."""
        if self.sliding_window is None:
            return 0
        dead = min(len(request.block_ids),
                   max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size)
        done = self._released.get(request.request_id, 0)
        if dead <= done:
            return 0
        self.pool.free(request.block_ids[done:dead])
        self._released[request.request_id] = dead
        self.num_released_blocks += dead - done
        return dead - done

    def _lock(self, request: Request, node: RadixNode) -> None:
        self.cache.lock(node)
        old = self._locked.pop(request.request_id, None)
        if old is not None:
            self.cache.unlock(old)
        self._locked[request.request_id] = node

    def free(self, request: Request, finished: bool = False) -> None:
        """Release the request's blocks (finished, aborted or preempted). Blocks in the prefix
        cache keep the tree's reference and stay there for later requests; a finished request
        of a session pins its computed prefix for the session's next turn."""
        if finished and request.session_id is not None and self.sessions is not None:
            full = min(len(request.block_ids), request.num_computed_tokens // self.block_size,
                       self._num_cached.get(request.request_id, 0))
            self.sessions.pin(request.session_id, request.all_token_ids, full, request.cache_salt)
        node = self._locked.pop(request.request_id, None)
        if node is not None:
            self.cache.unlock(node)
        self._num_cached.pop(request.request_id, None)
        released = self._released.pop(request.request_id, 0)
        if len(request.block_ids) > released:
            self.pool.free(request.block_ids[released:])
        request.block_ids = []

    def release_session(self, session_id: str) -> bool:
        """The session ended: its pinned prefix becomes ordinary cache (evictable)."""
        return self.sessions.release(session_id) if self.sessions is not None else False

    @property
    def num_session_pinned_blocks(self) -> int:
        return self.sessions.num_pinned_blocks if self.sessions is not None else 0

    def reset_prefix_cache(self) -> None:
        if self.cache is not None:
            self.pool.free(self.cache.reset())
