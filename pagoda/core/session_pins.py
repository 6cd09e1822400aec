"""Sessions' KV prefixes kept in the prefix cache between turns ("incremental encoding").

A conversation's next turn starts with everything the last turn computed (its prompt and its
answer), so if those blocks are still cached, the turn computes only its new tokens. Plain LRU
would keep them only while nothing else needs the room; a live session instead *pins* its
prefix: when a turn's request finishes, the radix-tree node where its computed blocks end stays
locked for the session (the previous turn's pin is let go), so eviction cannot take it.

Pins are a soft hold, within two budgets:
- per session: at most `max_blocks_per_session` blocks (a longer history pins its first ones);
- overall: at most `max_total_blocks`; a new pin past that lets go of the least recently used.
And under pressure they yield before any running request is preempted: an allocation that finds
too few free blocks unpins sessions, least recently used first (`release_for`). An unpinned
session loses nothing but speed: its next turn recomputes what is no longer cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagoda.core.radix_cache import RadixCache, RadixNode


@dataclass
class SessionPin:
    node: RadixNode  # deepest pinned node: the path from the root to it stays locked
    num_blocks: int


class SessionPins:
    def __init__(self, cache: RadixCache, max_blocks_per_session: int, max_total_blocks: int) -> None:
        self.cache = cache
        self.max_blocks_per_session = max(0, max_blocks_per_session)
        self.max_total_blocks = max(0, max_total_blocks)
        self._pins: OrderedDict[str, SessionPin] = OrderedDict()  # least recently used first
        self.num_pinned_blocks = 0
        self.num_released_under_pressure = 0

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pins

    def pin(self, session_id: str, tokens: list[int], num_blocks: int, salt) -> None:
        """Hold the first `num_blocks` full blocks of `tokens` (already in the tree) for the
        session, in place of what it held before."""
        num_blocks = min(num_blocks, self.max_blocks_per_session, self.max_total_blocks)
        if num_blocks <= 0:
            self.release(session_id)
            return
        match = self.cache.match(tokens[: num_blocks * self.cache.block_size], salt)
        if not match.blocks:
            self.release(session_id)
            return
        self.cache.lock(match.node)  # before letting the old pin go: a shared path stays locked
        self.release(session_id)
        self._pins[session_id] = SessionPin(match.node, match.num_blocks)
        self.num_pinned_blocks += match.num_blocks
        while self.num_pinned_blocks > self.max_total_blocks:
            self._release_oldest()

    def release(self, session_id: str) -> bool:
        """Let the session's prefix go (the session ended or expired); its blocks stay cached
        until LRU eviction needs them."""
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        self.cache.unlock(pin.node)
        self.num_pinned_blocks -= pin.num_blocks
        return True

    def release_for(self, needed: int, num_free: callable) -> None:
        """Unpin sessions, least recently used first, until `num_free()` reaches `needed`."""
        while self._pins and num_free() < needed:
            self._release_oldest()
            self.num_released_under_pressure += 1

    def _release_oldest(self) -> None:
        self.release(next(iter(self._pins)))
