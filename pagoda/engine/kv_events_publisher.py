"""Publishing the KV cache's events over ZMQ in vLLM's wire format, so the subscribers written for
vLLM (llm-d's KV-cache manager, NVIDIA Dynamo's router, vLLM's own example subscriber) read
pagoda's unchanged: a PUB socket bound at ``endpoint``; each message three frames, the topic, an
8-byte big-endian sequence number, and a msgpack ``KVEventBatch`` (``[ts, [event, ...]]``, each event
an array tagged with its class name: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium]``), as msgspec encodes vLLM's array-like tagged structs. The socket
is written by a thread of its own, so a step never waits on the network.

As vLLM does: the PUB socket binds an endpoint with a wildcard (``tcp://*:5557``, ``::``,
``0.0.0.0``) or an ``ipc://`` / ``inproc://`` one and connects to any other (a collector that
binds, as llm-d's does). With ``replay_endpoint`` a ROUTER socket there answers a subscriber that
missed batches (a gap in the sequence numbers): it sends the 8-byte sequence number to start from
and gets every batch still held (the last ``buffer_steps``) as ``(seq, payload)``, then ``(-1, b"")``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from pagoda.core import kv_events
from pagoda.core.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame: nothing more held
POLL_MS = 100  # how often the publisher's thread looks at the replay socket while no batch comes


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


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or a local transport is bound, anything else connected to."""
    return any(part in endpoint for part in ("*", "::", "0.0.0.0")) or endpoint.startswith(("ipc://", "inproc://"))


def _open(context: zmq.Context, kind: int, endpoint: str, field: str, *, bind: bool) -> zmq.Socket:
    socket = context.socket(kind)
    try:
        socket.bind(endpoint) if bind else socket.connect(endpoint)
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        raise ValueError(f"kv_events_config.{field} {endpoint!r}: {exc}") from None
    return socket


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._context = zmq.Context.instance()
        self._socket = _open(self._context, zmq.PUB, config.endpoint, "endpoint", bind=binds(config.endpoint))
        self._socket.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        if config.replay_endpoint:
            self._replay = _open(self._context, zmq.ROUTER, config.replay_endpoint, "replay_endpoint", bind=True)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(config.buffer_steps, 1))
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (topic %r)%s", config.endpoint, config.topic,
                    f", replay on {config.replay_endpoint}" if self._replay else "")

    def publish(self, events: list[kv_events.KVCacheEvent]) -> None:
        """Queue a step's events (dropped, with a warning, when the queue is full)."""
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), [_wire(e) for e in events]))
        except queue.Full:
            logger.warning("KV events: the queue is full; a batch of %d events is dropped", len(events))

    def _run(self) -> None:
        """The sockets' one thread (ZMQ sockets are not thread-safe): batches out, replays answered."""
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=POLL_MS / 1000 if self._replay is not None else None)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(batch)
            self._socket.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _answer_replay(self) -> None:
        """One request: (identity, b"", start seq) from a REQ or DEALER socket."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames is ignored", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._socket.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)
