"""KV cache groups (Gemma 3's local layers apart from its global ones): which layers share a block
table, and the manager's bookkeeping: windowed groups give back what their window has passed,
with or without the prefix cache; the tree keeps those blocks until the room is needed, and a
prefix hit is cut back to where its last window is complete. Every block is accounted for."""

from __future__ import annotations

from pagoda.core.kv_cache_groups import KVCacheGroups, kv_groups_for, plan_kv_groups
from pagoda.core.kv_cache_manager import UNREAD_BLOCK, KVCacheManager
from pagoda.core.block_tables import add_blocks, add_prefix, clear_blocks
from pagoda.models.config import layer_windows
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4
W = 6  # a window of 1.5 blocks


def gemma3_windows(num_layers: int, window: int = 512) -> tuple:
    return layer_windows({"sliding_window": window, "sliding_window_pattern": 6}, num_layers)


def test_gemma3_270m_and_1b_layouts():
    plan = plan_kv_groups(gemma3_windows(18))  # 270M: layers 5, 11, 17 global
    assert (plan.num_groups, plan.slots_per_block, plan.local_window) == (6, 3, 512)
    assert [plan.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert sorted(zip(plan.layer_group, plan.layer_slot)) == sorted({(g, s) for g in range(6) for s in range(3)})
    plan = plan_kv_groups(gemma3_windows(26))  # 1B: 4 global, 22 local in 6 groups of 4 slots (2 left empty)
    assert (plan.num_groups, plan.slots_per_block) == (7, 4)
    assert len(set(zip(plan.layer_group, plan.layer_slot))) == 26


def test_one_group_where_splitting_does_not_pay():
    assert not plan_kv_groups([None] * 4).is_hybrid  # every layer global
    assert not plan_kv_groups([8] * 4).is_hybrid  # every layer windowed (Mistral: released another way)
    assert not plan_kv_groups([None, None, None, 8]).is_hybrid  # more global layers than windowed ones
    assert not plan_kv_groups([None, 8, 16, 8]).is_hybrid  # two windows
    assert not plan_kv_groups(gemma3_windows(18), allow_hybrid=False).is_hybrid
    single = KVCacheGroups.single(3)
    assert (single.layer_slot, single.num_groups, single.slots_per_block) == ((0, 1, 2), 1, 3)

    class Config:
        num_layers, sliding_windows = 18, gemma3_windows(18)

    class DraftModel:
        method = "draft_model"

    assert kv_groups_for(Config).is_hybrid and not kv_groups_for(Config, DraftModel).is_hybrid


def manager(num_blocks: int, prefix_caching: bool) -> KVCacheManager:
    # one global layer, two windowed ones: groups 0 (global), 1 and 2
    return KVCacheManager(num_blocks, BS, prefix_caching, kv_groups=plan_kv_groups([W, None, W]))


def step(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Compute ``num_tokens`` more of the request's tokens, as the scheduler drives a step."""
    assert add_blocks(request, kv.allocate_slots(request, num_tokens))
    request.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(request)
    kv.release_out_of_window(request)


def held(kv: KVCacheManager) -> int:
    return kv.pool.num_used_blocks


def test_windowed_groups_hold_only_their_window_without_prefix_caching():
    kv = manager(64, prefix_caching=False)
    request = Request("r", list(range(40)), SamplingParams(max_tokens=1))
    for _ in range(10):
        step(kv, request, 4)
    # 10 blocks in group 0; groups 1 and 2 hold the blocks from the window's first one on
    first = (40 - W + 1) // BS
    assert len(request.block_ids) == 10 and all(len(ids) == 10 for ids in request.group_block_ids)
    assert held(kv) == 10 + 2 * (10 - first)
    assert kv.num_released_blocks == 2 * first
    kv.free(request)
    clear_blocks(request)
    assert held(kv) == 0


def test_the_tree_keeps_passed_blocks_until_the_room_is_needed():
    kv = manager(40, prefix_caching=True)
    prompt = list(range(32))
    first = Request("a", prompt + [999], SamplingParams(max_tokens=1))
    step(kv, first, 32)
    assert held(kv) == 3 * 8  # the tree still holds every group's blocks ...
    assert kv.num_evictable_blocks == 2 * ((32 - W + 1) // BS)  # ... but the passed ones may go
    kv.free(first)
    clear_blocks(first)

    # A hit on the whole prompt finds every group's last window: nothing to recompute.
    again = Request("b", prompt + [5, 6], SamplingParams(max_tokens=1))
    assert add_prefix(again, kv.match_prefix(again), kv.block_size) == 32
    start = (32 - W + 1) // BS
    assert all(ids[:start] == [UNREAD_BLOCK] * start for ids in again.group_block_ids)
    kv.free(again)
    clear_blocks(again)

    # Room needed: the windowed blocks only the tree holds go first (least recently let go
    # first), the tree's nodes stay.
    assert kv.num_evictable_blocks == 8 + 2 * 8 and kv.pool.num_free_blocks == 16
    other = Request("c", list(range(500, 541)), SamplingParams(max_tokens=1))
    assert add_blocks(other, kv.allocate_slots(other, 40))  # 10 blocks in each of 3 groups: the 16 free and 14 windowed ones
    assert kv.cache.num_cached_blocks == 8 and kv.num_evictable_blocks == 8 + 2
    kv.free(other)
    clear_blocks(other)
    probe = Request("d", prompt + [5], SamplingParams(max_tokens=1))
    assert add_prefix(probe, kv.match_prefix(probe), kv.block_size) == 0  # no point of the prompt has its last window complete
    kv.free(probe)
    clear_blocks(probe)
    kv.reset_prefix_cache()
    assert held(kv) == 0


def test_a_hit_ends_where_its_window_is_complete():
    kv = manager(64, prefix_caching=True)
    prompt = list(range(40))
    request = Request("a", prompt + [1], SamplingParams(max_tokens=1))
    step(kv, request, 40)
    kv.free(request)
    clear_blocks(request)
    # Evict every windowed block that only the tree holds: the blocks of the last window too.
    kv.pool.free(kv.cache.evict(len(kv.cache._evictable_extras)))
    evicted = Request("b", prompt + [1], SamplingParams(max_tokens=1))
    assert add_prefix(evicted, kv.match_prefix(evicted), kv.block_size) == 0
    # A prefix whose window lies in blocks still cached by a running request is usable.
    runner = Request("c", prompt[:8] + [7] * 8, SamplingParams(max_tokens=1))
    assert add_prefix(runner, kv.match_prefix(runner), kv.block_size) == 0
    step(kv, runner, 16)
    probe = Request("d", prompt[:8] + [7] * 8 + [3], SamplingParams(max_tokens=1))
    assert add_prefix(probe, kv.match_prefix(probe), kv.block_size) == 16
    kv.free(probe)
    clear_blocks(probe)
    kv.free(runner)
    clear_blocks(runner)
    kv.reset_prefix_cache()
    assert held(kv) == 0


def test_preemption_and_abort_give_every_block_back():
    kv = manager(30, prefix_caching=True)
    request = Request("a", list(range(24)), SamplingParams(max_tokens=4))
    step(kv, request, 12)
    step(kv, request, 12)
    kv.free(request)  # preempted or aborted mid-way
    clear_blocks(request)
    kv.reset_prefix_cache()
    assert held(kv) == 0 and kv.num_free_blocks == 30
