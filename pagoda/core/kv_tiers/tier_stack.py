"""The tiers below host memory as one: a local directory and the shared store side by side.

With both ``--kv-offload-dir`` and ``--kv-offload-url``, a block is written to each (the directory
survives this replica's restart at disk speed; the store reaches other hosts), and looked up in the
directory first, the nearer one, then in the store. Beside, not below: nothing moves from one to the
other, so neither waits on the other, and each keeps its own budget (the directory's files, the
server's ``maxmemory``).
"""

from __future__ import annotations

from typing import Protocol


class BlockTier(Protocol):
    """What the store (``store.KVTierStore``) asks of a tier below memory."""

    name: str
    num_hits: int
    num_refused: int

    def has(self, key: bytes) -> bool: ...

    def read(self, key: bytes) -> bytes | None: ...

    def write(self, key: bytes, payload: bytes) -> None: ...


class TierStack:
    """Several ``BlockTier``s, nearest first, behind the one interface."""

    name = "stack"

    def __init__(self, tiers: list[BlockTier]) -> None:
        self.tiers = tiers

    @property
    def num_hits(self) -> int:
        return sum(t.num_hits for t in self.tiers)

    @property
    def num_refused(self) -> int:
        return sum(t.num_refused for t in self.tiers)

    def has(self, key: bytes) -> bool:
        return any(t.has(key) for t in self.tiers)

    def read(self, key: bytes) -> bytes | None:
        for t in self.tiers:
            payload = t.read(key)
            if payload is not None:
                return payload
        return None

    def write(self, key: bytes, payload: bytes) -> None:
        for t in self.tiers:
            if not t.has(key):  # a block another replica put in the store is not sent again
                t.write(key, payload)


def hits_of(tier: BlockTier | None, name: str) -> int:
    """Blocks read back whole from the tier called ``name`` (``disk``, ``remote``) in ``tier``."""
    if tier is None:
        return 0
    parts = tier.tiers if isinstance(tier, TierStack) else [tier]
    return sum(t.num_hits for t in parts if t.name == name)
