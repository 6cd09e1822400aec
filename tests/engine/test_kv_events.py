"""The prefix cache's events over ZMQ, read by a subscriber written from vLLM's published event
schema (``vllm.distributed.kv_events``, as its examples/online_serving/kv_events_subscriber.py
declares it): blocks stored as prompts are computed (their tokens, the chain of parent hashes,
the block size), removed when the tree evicts them, all cleared on a reset; topic and sequence
frames as vLLM sends them."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from pagoda import LLM, SamplingParams


# -- vLLM's event schema (types as vLLM publishes them) ----------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    def __init__(self, port: int, topic: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.seqs: list[int] = []
        self.events: list[KVCacheEvent] = []

    def read(self, timeout_ms: int) -> None:
        """Read the batches that arrive within ``timeout_ms`` of each other."""
        while self.socket.poll(timeout_ms):
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == b"kv-events"
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(self.decoder.decode(payload).events)

    def drain(self, until, deadline_s: float = 20.0) -> None:
        """Read batches until ``until(events)`` holds (or fail at the deadline)."""
        deadline = time.monotonic() + deadline_s
        while not until(self.events):
            assert time.monotonic() < deadline, f"no such events within {deadline_s}s ({len(self.events)} others)"
            self.read(200)


@pytest.fixture(scope="module")
def engine_and_subscriber(tiny_llama):
    port, replay = _free_port(), _free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.002, kv_events_config=json.dumps(config),
              block_size=16)
    subscriber = Subscriber(port, "kv-events")
    # a SUB socket misses what was published before it joined: run a probe until its events arrive
    deadline = time.monotonic() + 20
    while not subscriber.events:
        assert time.monotonic() < deadline, "the subscriber never received an event"
        llm.engine.core.kv_manager.reset_prefix_cache()
        llm.generate(["A probe prompt that fills one block of sixteen tokens or more, surely."],
                     SamplingParams(max_tokens=1), use_tqdm=False)
        subscriber.read(500)
    subscriber.replay_port = replay
    yield llm, subscriber
    llm.engine.core.shutdown()


def test_stored_blocks_carry_their_tokens_and_chain(engine_and_subscriber):
    llm, sub = engine_and_subscriber
    prompt = "The quick brown fox jumps over the lazy dog, " * 6
    ids = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    sub.drain(lambda events: any(isinstance(e, BlockStored) and e.token_ids[:16] == ids[:16] for e in events))
    stored = [e for e in sub.events if isinstance(e, BlockStored) and e.token_ids[:16] == ids[:16]][-1]
    full = (len(ids) - 1) // 16  # the blocks the prompt filled (the last token is computed with the answer)
    assert stored.block_size == 16 and stored.parent_block_hash is None and stored.lora_id is None
    assert stored.token_ids == ids[:len(stored.block_hashes) * 16] and len(stored.block_hashes) >= full
    assert len(set(stored.block_hashes)) == len(stored.block_hashes)
    assert sub.seqs == sorted(sub.seqs) and len(set(sub.seqs)) == len(sub.seqs)  # vLLM's sequence numbers


def test_eviction_removes_and_a_reset_clears(engine_and_subscriber):
    llm, sub = engine_and_subscriber
    stored = {h for e in sub.events if isinstance(e, BlockStored) for h in e.block_hashes}
    # distinct prompts past the cache's size: the tree must evict blocks it stored before
    evicted = lambda events: any(isinstance(e, BlockRemoved) and set(e.block_hashes) & stored for e in events)  # noqa: E731
    for round_ in range(8):  # (a few rounds hold more blocks than the cache: see num_blocks)
        prompts = [f"Round {round_}, prompt {i}: something unlike any other prompt here. " * 4 for i in range(32)]
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        sub.read(200)
        if evicted(sub.events):
            break
    assert llm.engine.core.num_blocks < 8 * 32 * 4
    sub.drain(evicted)
    llm.engine.core.kv_manager.reset_prefix_cache()
    llm.generate(["After the reset."], SamplingParams(max_tokens=1), use_tqdm=False)
    sub.drain(lambda events: any(isinstance(e, AllBlocksCleared) for e in events))


def _replay(port: int, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay exchange: the sequence number to start from, then (seq, payload) frames up to
    the end marker (seq -1, empty payload)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        answers = []
        while dealer.poll(10_000):
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return answers
            answers.append((int.from_bytes(seq, "big"), payload))
        raise AssertionError("the replay never ended")
    finally:
        dealer.close(linger=0)


def test_a_subscriber_that_missed_batches_gets_them_replayed(engine_and_subscriber):
    llm, sub = engine_and_subscriber
    llm.generate(["A prompt for the replay test, long enough to fill a block or two of the cache."],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    sub.drain(lambda events: bool(events))
    sub.read(300)
    last = sub.seqs[-1]
    replayed = _replay(sub.replay_port, last - 1)
    assert [seq for seq, _ in replayed] == [last - 1, last]  # every held batch from the one asked for
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    assert all(isinstance(decoder.decode(payload), KVEventBatch) for _, payload in replayed)
    assert _replay(sub.replay_port, last + 1000) == []  # nothing held past the last: just the end marker


def test_an_endpoint_without_a_wildcard_is_connected_to(tiny_llama):
    """vLLM's rule: ``tcp://HOST:PORT`` connects (a collector binds, as llm-d's does)."""
    port = _free_port()
    collector = zmq.Context.instance().socket(zmq.SUB)
    collector.bind(f"tcp://127.0.0.1:{port}")
    collector.setsockopt_string(zmq.SUBSCRIBE, "")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "topic": "t"}
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.002, kv_events_config=json.dumps(config),
              block_size=16)
    try:
        deadline = time.monotonic() + 20
        while not collector.poll(200):
            assert time.monotonic() < deadline, "the collector never received a batch"
            llm.engine.core.kv_manager.reset_prefix_cache()
            llm.generate(["A prompt that fills a block of sixteen tokens or more for the collector."],
                         SamplingParams(max_tokens=1), use_tqdm=False)
        assert collector.recv_multipart()[0] == b"t"
    finally:
        llm.engine.core.shutdown()
        collector.close(linger=0)


def test_a_bad_config_names_the_field(tiny_llama):
    with pytest.raises(ValueError, match="unknown field"):
        LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.002, kv_events_config='{"endpont": "x"}')
