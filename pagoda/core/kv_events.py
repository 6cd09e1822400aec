"""KV cache events in vLLM's shape (``vllm.distributed.kv_events``): which blocks the prefix cache
holds, for a router or a KV-aware scheduler outside the engine (llm-d's endpoint picker, NVIDIA
Dynamo's router). The KV cache manager records a ``BlockStored`` when full blocks enter the radix
tree (computed, or brought back from a KV tier), a ``BlockRemoved`` when the tree evicts them and an
``AllBlocksCleared`` on a reset; the engine core takes them after each step and publishes them
(engine/kv_events_publisher.py).

A block's hash chains its parent's, its tokens and the request's prefix key (tenant salt, LoRA
adapter), as vLLM's block hashes do: 64 bits of BLAKE2b, so equal prefixes under equal keys get
equal hashes on every replica of one model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from pagoda.request import Request


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = "CPU"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = "CPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields (a JSON object)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" records nothing
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000  # ZMQ's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread
    replay_endpoint: str | None = None  # a ROUTER socket that resends held batches (kv_events_publisher.py)
    buffer_steps: int = 10_000  # batches held for replay

    @classmethod
    def parse(cls, text: str | dict | None) -> KVEventsConfig | None:
        """The config, or None when events are off; a ValueError names a bad field."""
        if text is None:
            return None
        try:
            fields = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field(s) {', '.join(sorted(unknown))}")
        config = cls(**fields)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {config.publisher!r}")
        return config if config.enable_kv_cache_events and config.publisher == "zmq" else None


def _chain(parent: int | None, tokens: list[int], prefix_key: object) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"root" if parent is None else parent.to_bytes(8, "big"))
    digest.update(repr(prefix_key).encode() if parent is None else b"")
    digest.update(b",".join(str(t).encode() for t in tokens))
    return int.from_bytes(digest.digest(), "big")


@dataclass
class KVEventLog:
    """The events since the last ``take``, and the hash of every block in the radix tree."""

    block_size: int
    events: list[KVCacheEvent] = field(default_factory=list)
    block_hash: dict[int, int] = field(default_factory=dict)  # block id in the tree → its hash

    def stored(self, request: Request, block_ids: list[int], have: int, full: int) -> None:
        """``block_ids[have:full]`` (of ``request``) entered the tree after its first ``have`` blocks."""
        bs, tokens = self.block_size, request.all_token_ids
        keys = request.cache_token_ids  # an image's placeholders hash as its pixels' hash
        parent = self.block_hash.get(block_ids[have - 1]) if have else None
        first_parent, hashes = parent, []
        for i in range(have, full):
            parent = _chain(parent, keys[i * bs:(i + 1) * bs], request.prefix_key)
            self.block_hash[block_ids[i]] = parent
            hashes.append(parent)
        if hashes:
            self.events.append(BlockStored(hashes, first_parent, list(tokens[have * bs:full * bs]), bs,
                                           request.lora_id or None))

    def removed(self, block_ids: list[int]) -> None:
        hashes = [self.block_hash.pop(b) for b in block_ids if b in self.block_hash]
        if hashes:
            self.events.append(BlockRemoved(hashes))

    def cleared(self) -> None:
        self.block_hash.clear()
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
