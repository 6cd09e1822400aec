import pytest

from pagoda.core.block_pool import BlockPool


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
