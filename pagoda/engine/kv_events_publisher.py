"""Publishing the KV cache's events over ZMQ in vLLM's wire format, so the subscribers written for
vLLM (llm-d's KV-cache manager, NVIDIA Dynamo's router, vLLM's own example subscriber) read
pagoda's unchanged: a PUB socket bound at ``endpoint``; each message three frames, the topic, an
8-byte big-endian sequence number, and a msgpack ``KVEventBatch`` (``[ts, [event, ...]]``, each event
an array tagged with its class name: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium]``), as msgspec encodes vLLM's array-like tagged structs. The socket
is written by a thread of its own, so a step never waits on the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import zmq

from pagoda.core import kv_events
from pagoda.core.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _wire(event: kv_events.KVCacheEvent) -> _Event:
    if isinstance(event, kv_events.BlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           event.lora_id, event.medium)
    if isinstance(event, kv_events.BlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        try:
            self._socket.bind(config.endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise ValueError(f"kv_events_config.endpoint {config.endpoint!r}: {exc}") from None
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (topic %r)", config.endpoint, config.topic)

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        """Queue a step's events (dropped, with a warning, when the queue is full)."""
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), [_wire(e) for e in events]))
        except queue.Full:
            logger.warning("KV events: the queue is full; a batch of %d events is dropped", len(events))

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            self._socket.send_multipart((self.topic, self._seq.to_bytes(8, "big"), self._encoder.encode(batch)))
            self._seq += 1

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._socket.close(linger=100)
