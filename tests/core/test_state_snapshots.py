"""The states kept after cached prefixes (state-space models): saved at the interval's
boundaries a step passes, found only once that step ran, cut a tree hit to the deepest kept
boundary, and reused least recently used first when the slots run out."""

from __future__ import annotations

from pagoda.core.state_snapshots import StateSnapshots
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


def request(tokens: list[int], computed: int = 0, salt: str | None = None) -> Request:
    r = Request("r", tokens, SamplingParams(max_tokens=4), cache_salt=salt)
    r.num_computed_tokens = computed
    return r


TOKENS = list(range(100, 150))


def test_saves_land_on_the_interval_rounded_to_blocks_and_show_after_the_step():
    snaps = StateSnapshots(first_slot=4, num_slots=3, interval=6, block_size=4)  # every 8 tokens
    assert snaps.interval == 8
    saves = snaps.plan_saves(request(TOKENS, computed=5), 20)  # tokens 5..24: boundaries 8, 16, 24
    assert [k for k, _ in saves] == [3, 11, 19] and sorted(s for _, s in saves) == [4, 5, 6]
    assert snaps.usable_blocks(TOKENS, None, 6) == 0  # not written yet
    assert snaps.plan_saves(request(TOKENS, computed=5), 20) == []  # pending: not planned twice
    snaps.commit()
    assert snaps.usable_blocks(TOKENS, None, 6) == 6  # 24 tokens: the boundary at 24
    assert snaps.usable_blocks(TOKENS, None, 5) == 4  # 20 cached tokens: back to 16
    assert snaps.usable_blocks(TOKENS, "another salt", 6) == 0
    assert snaps.usable_blocks(TOKENS[:20] + [0] * 4, None, 6) == 4  # differs after 16


def test_a_hit_copies_the_kept_state_into_the_requests_slot():
    snaps = StateSnapshots(first_slot=2, num_slots=2, interval=8, block_size=8)
    snaps.plan_saves(request(TOKENS, computed=0), 20)
    snaps.commit()
    hit = request(TOKENS[:16] + [7, 7, 7], computed=16)
    hit.state_slot = 1
    assert snaps.copy_for(hit) == (3, 1) and snaps.num_hits == 1  # the save at 16 took the second slot
    assert snaps.copy_for(request(TOKENS, computed=0)) is None


def test_full_slots_reuse_the_least_recently_used_snapshot():
    snaps = StateSnapshots(first_slot=0, num_slots=2, interval=4, block_size=4)
    snaps.plan_saves(request(TOKENS, computed=0), 8)  # boundaries 4 and 8
    snaps.commit()
    used = request(TOKENS[:4] + [1], computed=4)
    used.state_slot = 9
    snaps.copy_for(used)  # 4 is now the most recently used
    saves = snaps.plan_saves(request([5] * 12, computed=0), 4)
    assert [s for _, s in saves] == [1]  # the snapshot at 8 made room
    snaps.commit()
    assert snaps.usable_blocks(TOKENS, None, 2) == 1
    snaps.reset()
    assert snaps.usable_blocks(TOKENS, None, 2) == 0
