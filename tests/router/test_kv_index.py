"""The router's index of the workers' prefix caches (pagoda/router/kv_index.py), fed the event
structs the engine publishes (engine/kv_events_publisher.py): a prompt matches the leading whole
blocks a worker holds; removed blocks stop matching; a gap in the sequence numbers or a restarted
sequence forgets the worker; an adapter's blocks and blocks whose parent was never seen are not
indexed."""

from __future__ import annotations

from pagoda.engine.kv_events_publisher import AllBlocksCleared, BlockRemoved, BlockStored
from pagoda.router.kv_index import KVBlockIndex

A, B = "http://a:8000", "http://b:8000"
TOKENS = list(range(100, 140))  # 40 tokens: two blocks of 16, and 8 more


def _index() -> KVBlockIndex:
    index = KVBlockIndex()
    index.add_worker(A)
    index.add_worker(B)
    return index


def _stored(hashes, parent, tokens, lora_id=None) -> BlockStored:
    return BlockStored(hashes, parent, tokens, 16, lora_id, "CPU")


def test_a_prompt_matches_the_leading_blocks_a_worker_holds():
    index = _index()
    index.apply(A, 0, [_stored([11, 12], None, TOKENS[:32])])
    index.apply(B, 0, [_stored([21], None, TOKENS[:16])])
    assert index.match(TOKENS, [A, B]) == {A: 32, B: 16}
    other = [7] + TOKENS[1:]  # the first block differs: nothing after it counts
    assert index.match(other, [A, B]) == {A: 0, B: 0}
    # a later batch extends a stored chain through its parent's engine hash
    index.apply(B, 1, [_stored([22], 21, TOKENS[16:32])])
    assert index.match(TOKENS, [B]) == {B: 32}


def test_removed_blocks_stop_matching_and_a_clear_forgets_all():
    index = _index()
    index.apply(A, 5, [_stored([11, 12], None, TOKENS[:32])])
    index.apply(A, 6, [BlockRemoved([12], "CPU")])
    assert index.match(TOKENS, [A]) == {A: 16}
    index.apply(A, 7, [AllBlocksCleared()])
    assert index.match(TOKENS, [A]) == {A: 0} and index.blocks(A) == 0


def test_a_gap_or_a_restart_forgets_the_worker():
    index = _index()
    index.apply(A, 0, [_stored([11, 12], None, TOKENS[:32])])
    index.apply(A, 2, [])  # batch 1 was lost: what A holds is no longer known
    assert index.blocks(A) == 0 and index.resets == 1
    index.apply(A, 3, [_stored([11], None, TOKENS[:16])])
    index.apply(A, 0, [])  # A restarted (its sequence began again): its cache is empty
    assert index.blocks(A) == 0 and index.resets == 2


def test_adapter_blocks_and_orphans_are_not_indexed():
    index = _index()
    index.apply(A, 0, [_stored([11], None, TOKENS[:16], lora_id=3)])
    index.apply(B, 0, [_stored([22], 999, TOKENS[16:32])])  # its parent was stored before the router listened
    assert index.match(TOKENS, [A, B]) == {A: 0, B: 0}
    assert index.blocks(A) == index.blocks(B) == 0
