"""A consistent-hash ring with virtual nodes: which worker a session key belongs to.

Each worker is placed on a 64-bit ring at `vnodes` pseudo-random points; a key belongs to the
first point at or after its own hash. Adding or removing one of N workers therefore moves only
the keys of the arcs that worker gains or loses, about 1/N of them, while every other session
keeps its worker (and the KV cache that worker holds for it). Many virtual nodes per worker
keep the arcs even: with 160 the share of each of 4 workers is within a few percent of 1/4.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator

DEFAULT_VNODES = 160


def hash64(text: str) -> int:
    """A stable 64-bit hash (Python's `hash` is salted per process, so it cannot be shared by
    router restarts or replicas of the router)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def unit_fraction(text: str) -> float:
    """A stable number in [0, 1) for a key, used to admit a fixed part of the keys (warm-up)."""
    return hash64("fraction:" + text) / 2**64


class HashRing:
    """Workers (any strings) on a ring of virtual nodes; `walk(key)` yields them in ring order."""

    def __init__(self, nodes: list[str] | tuple[str, ...] = (), vnodes: int = DEFAULT_VNODES) -> None:
        self.vnodes = vnodes
        self._points: list[int] = []  # sorted hashes of the virtual nodes
        self._owner: dict[int, str] = {}  # virtual-node hash -> worker
        self._nodes: set[str] = set()
        for node in nodes:
            self.add(node)

    def __contains__(self, node: str) -> bool:
        return node in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def nodes(self) -> set[str]:
        return set(self._nodes)

    def add(self, node: str) -> None:
        if node in self._nodes:
            return
        self._nodes.add(node)
        for i in range(self.vnodes):
            point = hash64(f"{node}#{i}")
            if point in self._owner:  # a 64-bit collision: keep the first owner, skip this point
                continue
            self._owner[point] = node
            bisect.insort(self._points, point)

    def remove(self, node: str) -> None:
        if node not in self._nodes:
            return
        self._nodes.discard(node)
        mine = {p for p, owner in self._owner.items() if owner == node}
        self._points = [p for p in self._points if p not in mine]
        for p in mine:
            del self._owner[p]

    def lookup(self, key: str) -> str | None:
        """The key's worker, or None on an empty ring."""
        return next(self.walk(key), None)

    def walk(self, key: str) -> Iterator[str]:
        """Every worker once, starting with the key's own and going clockwise: the order in which
        to fall back when the key's worker cannot take the request. The fallback of a key is
        itself stable, so while a worker is down its sessions all move to the same places."""
        if not self._points:
            return
        start = bisect.bisect_left(self._points, hash64(key))
        seen: set[str] = set()
        n = len(self._points)
        for i in range(n):
            node = self._owner[self._points[(start + i) % n]]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self._nodes):
                    return
