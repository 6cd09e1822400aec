"""The KV cache manager (pagoda/core/kv_cache_manager.py) on its own: whole blocks as a request
grows, nothing taken when there is no room, the prefix cache's hits (a token always left to
compute, salts kept apart), unused cached blocks counted free and evicted on demand."""

from __future__ import annotations

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.block_tables import add_blocks, add_prefix, clear_blocks
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4


def _request(n_prompt: int, rid: str = "r", salt: str | None = None, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=4), cache_salt=salt)


def _run_prompt(kv: KVCacheManager, request: Request) -> None:
    """Admit ``request`` as the scheduler does, compute its whole prompt, and cache its blocks."""
    add_prefix(request, kv.match_prefix(request), kv.block_size)
    assert add_blocks(request, kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens))
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def test_manager_allocates_whole_blocks_as_tokens_grow():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    r = _request(20)
    assert kv.blocks_needed(r, 20) == 2
    assert add_blocks(r, kv.allocate_slots(r, 20)) and len(r.block_ids) == 2
    r.num_computed_tokens = 20
    assert add_blocks(r, kv.allocate_slots(r, 12)) and len(r.block_ids) == 2  # 32 tokens fit in 2 blocks
    r.num_computed_tokens = 32
    assert add_blocks(r, kv.allocate_slots(r, 1)) and len(r.block_ids) == 3
    big = _request(40)
    assert not add_blocks(big, kv.allocate_slots(big, 40))  # needs 3 blocks, 1 free: nothing changes
    assert big.block_ids == [] and kv.num_free_blocks == 1
    kv.free(r)
    clear_blocks(r)
    assert kv.num_free_blocks == 4 and r.block_ids == []


def test_a_cached_prefix_is_matched_and_a_token_is_left_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first = _request(12, "first")
    _run_prompt(kv, first)
    same = _request(12, "same")  # the same 12 tokens: 2 whole blocks hit, the last block is computed again
    assert add_prefix(same, kv.match_prefix(same), BS) == 8 and same.block_ids == first.block_ids[:2]
    longer = _request(14, "longer")
    assert add_prefix(longer, kv.match_prefix(longer), BS) == 12
    other = _request(12, "other", first=100)
    assert kv.match_prefix(other) is None


def test_a_salt_keeps_prefixes_apart():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    _run_prompt(kv, _request(9, "a", salt="tenant-a"))
    assert kv.match_prefix(_request(9, "b", salt="tenant-b")) is None
    assert kv.match_prefix(_request(9, "c")) is None
    assert kv.match_prefix(_request(9, "d", salt="tenant-a")) is not None


def test_unused_cached_blocks_count_free_and_are_evicted_on_demand():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    done = _request(16, "done")
    _run_prompt(kv, done)
    kv.free(done, finished=True)
    clear_blocks(done)
    assert kv.usage() == 0 and kv.num_evictable_blocks == 4 and kv.num_free_blocks == 4
    fresh = _request(16, "fresh", first=50)
    assert add_blocks(fresh, kv.allocate_slots(fresh, 16))  # takes the cached blocks back
    assert kv.num_evictable_blocks == 0 and kv.usage() == 1.0
    assert kv.match_prefix(_request(16, "again")) is None  # evicted
