"""The router's subscription to its workers' KV events (`pagoda serve --kv-events-config`): a ZMQ
SUB socket connected to each worker's publisher, read on the router's event loop, each batch
applied to the `KVBlockIndex` under the worker's URL.

Where a worker publishes: `--kv-events URL=ENDPOINT` names it for one worker (the endpoint its
publisher binds, e.g. tcp://10.0.0.5:5557); `--kv-events-port PORT` gives every other worker,
added or discovered later too, tcp://ITS-HOST:PORT (in Kubernetes every pod publishes on one port).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from pagoda.engine.kv_events_publisher import KVEventBatch
from pagoda.router.kv_index import KVBlockIndex

logger = logging.getLogger("pagoda.router")


class KVEventsSubscriber:
    """One SUB socket and reading task a worker; `add` / `remove` follow the router's workers."""

    def __init__(self, index: KVBlockIndex, endpoints: dict[str, str], port: int | None) -> None:
        self.index = index
        self.endpoints = endpoints
        self.port = port
        self.context = zmq.asyncio.Context.instance()
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.tasks: dict[str, asyncio.Task] = {}
        self.waiting: set[str] = set()  # workers added before the event loop ran (`start` subscribes them)
        self.undecodable = 0  # messages that were not vLLM's three frames of a KVEventBatch

    def endpoint_of(self, url: str) -> str | None:
        if url in self.endpoints:
            return self.endpoints[url]
        if self.port is None:
            return None
        return f"tcp://{urlsplit(url).hostname}:{self.port}"

    def start(self) -> None:
        """On the event loop: subscribe to the workers added before it ran."""
        waiting, self.waiting = self.waiting, set()
        for url in waiting:
            self.add(url)

    def add(self, url: str) -> None:
        """Subscribe to `url`'s events (a worker with no known endpoint is routed without them)."""
        endpoint = self.endpoint_of(url)
        if endpoint is None or url in self.tasks:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.waiting.add(url)
            return
        self.index.add_worker(url)
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        self.tasks[url] = loop.create_task(self._read(url, socket), name=f"kv-events {url}")
        logger.info("KV events of %s: subscribed at %s", url, endpoint)

    def remove(self, url: str) -> None:
        self.waiting.discard(url)
        task = self.tasks.pop(url, None)
        if task is not None:
            task.cancel()
        self.index.remove_worker(url)

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _read(self, url: str, socket: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await socket.recv_multipart()
                if len(frames) != 3:
                    self.undecodable += 1
                    continue
                try:
                    batch = self.decoder.decode(frames[2])
                except msgspec.DecodeError:
                    self.undecodable += 1
                    continue
                self.index.apply(url, int.from_bytes(frames[1], "big"), batch.events)
        finally:
            socket.close(linger=0)
