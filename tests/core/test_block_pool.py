import pytest

from pagoda.core.block_pool import BlockPool
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import add_blocks, clear_blocks
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


def test_allocate_and_free_accounting():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_free_blocks == 0 and pool.usage() == 1.0
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 5


def test_shared_blocks_are_freed_by_the_last_reference():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 2  # still referenced once
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def _request(n_prompt: int) -> Request:
    return Request("r", list(range(n_prompt)), SamplingParams(max_tokens=4))


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
