"""Sessions' pinned prefixes in the KV cache manager: kept across turns, within budgets, yielding
under pressure, let go when the session ends."""

from __future__ import annotations

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.block_tables import add_blocks, add_prefix, clear_blocks
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

BS = 4


def run_turn(kv: KVCacheManager, rid: str, tokens: list[int], session: str | None) -> Request:
    """A request that computes all of `tokens` and finishes (as the scheduler drives it)."""
    request = Request(rid, tokens, SamplingParams(max_tokens=1), session_id=session)
    hit = add_prefix(request, kv.match_prefix(request), kv.block_size)
    assert add_blocks(request, kv.allocate_slots(request, len(tokens) - hit))
    request.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(request)
    kv.free(request, finished=True)
    clear_blocks(request)
    return request


def cached_tokens(kv: KVCacheManager, tokens: list[int]) -> int:
    probe = Request("probe", tokens + [0], SamplingParams(max_tokens=1))
    hit = add_prefix(probe, kv.match_prefix(probe), kv.block_size)
    kv.free(probe)
    clear_blocks(probe)
    return hit


def fill_with_others(kv: KVCacheManager, num_blocks: int) -> None:
    """Other traffic takes `num_blocks` blocks at once (evicting what the cache may give up)."""
    hog = Request("hog", list(range(10_000, 10_000 + num_blocks * BS)), SamplingParams(max_tokens=1))
    assert add_blocks(hog, kv.allocate_slots(hog, num_blocks * BS))
    kv.free(hog)
    clear_blocks(hog)


def test_a_session_prefix_survives_eviction_that_takes_unpinned_blocks():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    history = list(range(3 * BS))
    run_turn(kv, "turn1", history, session="s")
    run_turn(kv, "other", list(range(500, 500 + 3 * BS)), session=None)
    assert kv.num_session_pinned_blocks == 3
    fill_with_others(kv, 5)  # 2 free + the other request's 3 cached blocks
    assert cached_tokens(kv, history) == 3 * BS
    assert cached_tokens(kv, list(range(500, 500 + 3 * BS))) == 0


def test_the_next_turn_pins_the_longer_prefix_in_place_of_the_last():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    turn1 = list(range(2 * BS + 1))
    run_turn(kv, "t1", turn1, session="s")
    turn2 = turn1 + list(range(100, 100 + 2 * BS))
    run_turn(kv, "t2", turn2, session="s")
    assert kv.num_session_pinned_blocks == len(turn2) // BS and len(kv.sessions) == 1
    fill_with_others(kv, 16 - len(turn2) // BS)
    assert cached_tokens(kv, turn2) == (len(turn2) // BS) * BS


def test_pins_yield_to_an_allocation_before_it_fails():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    run_turn(kv, "t1", list(range(4 * BS)), session="s")
    fill_with_others(kv, 8)  # needs every block: the pin lets go rather than fail the allocation
    assert kv.num_session_pinned_blocks == 0 and kv.sessions.num_released_under_pressure == 1
    assert kv.pool.num_free_blocks == 8


def test_per_session_and_overall_budgets():
    kv = KVCacheManager(32, BS, enable_prefix_caching=True, session_max_blocks=2, session_total_blocks=5)
    run_turn(kv, "a", list(range(4 * BS)), session="a")
    assert kv.num_session_pinned_blocks == 2  # the first two blocks of four
    run_turn(kv, "b", list(range(100, 100 + 4 * BS)), session="b")
    assert kv.num_session_pinned_blocks == 4
    run_turn(kv, "c", list(range(200, 200 + 4 * BS)), session="c")  # over 5: the oldest pin goes
    assert "a" not in kv.sessions and {"b", "c"} <= set(kv.sessions._pins)
    assert kv.num_session_pinned_blocks == 4


def test_ending_a_session_makes_its_blocks_ordinary_cache():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    history = list(range(3 * BS))
    run_turn(kv, "t1", history, session="s")
    assert kv.num_evictable_blocks == 0
    assert kv.release_session("s") and not kv.release_session("s")
    assert kv.num_evictable_blocks == 3 and cached_tokens(kv, history) == 3 * BS
    fill_with_others(kv, 8)
    assert cached_tokens(kv, history) == 0


def test_preempted_and_plain_requests_pin_nothing():
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    request = Request("r", list(range(2 * BS)), SamplingParams(max_tokens=1), session_id="s")
    assert add_blocks(request, kv.allocate_slots(request, 2 * BS))
    request.num_computed_tokens = 2 * BS
    kv.cache_computed_blocks(request)
    kv.free(request)  # a preemption: not finished
    clear_blocks(request)
    assert kv.num_session_pinned_blocks == 0
    run_turn(kv, "plain", list(range(50, 50 + 2 * BS)), session=None)
    assert kv.num_session_pinned_blocks == 0
