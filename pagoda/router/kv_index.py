"""Which worker's prefix cache holds which blocks, as the workers' KV events say (exact prefix
routing, the way llm-d's KV-cache indexer does it).

A worker publishes `BlockStored` when full blocks enter its radix tree and `BlockRemoved` when
they leave (pagoda/core/kv_events.py). The engine's block hashes chain the request's prefix key
(its tenant salt, its adapter), which the router does not know; so the index keys a block by a
hash of its own: the parent block's key and the block's token ids, as the router can compute it
from a prompt's tokens. Each worker's engine hashes map to these keys, which is how a
`BlockRemoved` (hashes only) finds what to drop. A request then matches, worker by worker, the
longest run of its prompt's leading full blocks that the worker holds.

Blocks stored under a LoRA adapter (`lora_id` set) are not indexed: the router routes base-model
prompts by them, and an adapter's blocks never serve those. A tenant's salted blocks are indexed
like any other (the salt is not in the events): at worst such a "hit" is a miss on the worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

ROOT = 0  # the parent key of a prompt's first block


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """The router's key of a block: 64 bits of BLAKE2b over its parent's key and its tokens."""
    digest = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    digest.update(b",".join(str(t).encode() for t in tokens))
    return int.from_bytes(digest.digest(), "big")


@dataclass
class _WorkerBlocks:
    keys: dict[int, int] = field(default_factory=dict)  # the engine's block hash -> the router's key
    held: dict[int, int] = field(default_factory=dict)  # the router's key -> how many engine hashes map to it
    last_seq: int | None = None  # the last batch's sequence number (a gap or a restart resets the worker)

    def store(self, engine_hash: int, key: int) -> None:
        if engine_hash not in self.keys:
            self.keys[engine_hash] = key
            self.held[key] = self.held.get(key, 0) + 1

    def remove(self, engine_hash: int) -> None:
        key = self.keys.pop(engine_hash, None)
        if key is not None:
            left = self.held[key] - 1
            if left:
                self.held[key] = left
            else:
                del self.held[key]


class KVBlockIndex:
    """The blocks each worker's prefix cache holds, fed by its event batches."""

    def __init__(self) -> None:
        self.workers: dict[str, _WorkerBlocks] = {}
        self.block_size: int | None = None  # learned from the first BlockStored
        self.resets = 0  # workers dropped after a gap in their sequence numbers or a restart

    def add_worker(self, url: str) -> None:
        self.workers.setdefault(url, _WorkerBlocks())

    def remove_worker(self, url: str) -> None:
        self.workers.pop(url, None)

    def blocks(self, url: str) -> int:
        worker = self.workers.get(url)
        return len(worker.held) if worker else 0

    def apply(self, url: str, seq: int, events: Iterable[Any]) -> None:
        """One batch of `url`'s events (the publisher's wire structs: BlockStored, BlockRemoved,
        AllBlocksCleared). A batch after a gap, or a sequence that started again (the worker
        restarted), drops what was known of the worker first: it can no longer be trusted."""
        worker = self.workers.get(url)
        if worker is None:
            return
        if worker.last_seq is not None and seq != worker.last_seq + 1:
            worker = self.workers[url] = _WorkerBlocks()
            self.resets += 1
        worker.last_seq = seq
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(worker, event)
            elif kind == "BlockRemoved":
                for engine_hash in event.block_hashes:
                    worker.remove(engine_hash)
            elif kind == "AllBlocksCleared":
                worker.keys.clear()
                worker.held.clear()

    def _stored(self, worker: _WorkerBlocks, event: Any) -> None:
        if event.lora_id is not None:
            return
        size = event.block_size
        self.block_size = self.block_size or size
        if event.parent_block_hash is None:
            parent = ROOT
        elif event.parent_block_hash in worker.keys:
            parent = worker.keys[event.parent_block_hash]
        else:  # its parent was never seen (stored before this router subscribed): unreachable from a prompt
            return
        for i, engine_hash in enumerate(event.block_hashes):
            parent = block_key(parent, event.token_ids[i * size:(i + 1) * size])
            worker.store(engine_hash, parent)

    def prompt_keys(self, token_ids: Sequence[int]) -> list[int]:
        """The keys of a prompt's full blocks, in order."""
        size = self.block_size
        if not size:
            return []
        keys, parent = [], ROOT
        for start in range(0, len(token_ids) - size + 1, size):
            parent = block_key(parent, token_ids[start:start + size])
            keys.append(parent)
        return keys

    def match(self, token_ids: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """For each of `urls`, how many of the prompt's leading tokens its cache holds (whole blocks)."""
        keys = self.prompt_keys(token_ids)
        matched = {}
        for url in urls:
            held = self.workers[url].held if url in self.workers else {}
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            matched[url] = n * (self.block_size or 0)
        return matched
