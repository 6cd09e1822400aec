"""The consistent-hash ring: stable lookups, even shares, and ~1/N of keys moving on join/leave."""

from __future__ import annotations

import pytest

from pagoda.router.hash_ring import HashRing, unit_fraction

KEYS = [f"session-{i}" for i in range(10_000)]


def _owners(ring: HashRing) -> dict[str, str]:
    return {k: ring.lookup(k) for k in KEYS}


def test_lookup_is_stable_and_empty_ring_has_no_owner():
    assert HashRing().lookup("x") is None
    a, b = HashRing(["w1", "w2", "w3"]), HashRing(["w3", "w1", "w2"])  # order of adding does not matter
    assert _owners(a) == _owners(b)


def test_shares_are_even():
    ring = HashRing([f"w{i}" for i in range(4)])
    counts: dict[str, int] = {}
    for owner in _owners(ring).values():
        counts[owner] = counts.get(owner, 0) + 1
    assert all(abs(c / len(KEYS) - 0.25) < 0.05 for c in counts.values()), counts


@pytest.mark.parametrize("n", [2, 4, 8])
def test_join_moves_about_one_in_n_plus_one_keys_and_only_to_the_newcomer(n):
    ring = HashRing([f"w{i}" for i in range(n)])
    before = _owners(ring)
    ring.add("new")
    after = _owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "new" for k in moved)  # nobody else's keys were reshuffled
    expected = 1 / (n + 1)
    assert abs(len(moved) / len(KEYS) - expected) < 0.35 * expected, (len(moved), expected)


@pytest.mark.parametrize("n", [3, 5])
def test_leave_moves_only_the_leavers_keys(n):
    ring = HashRing([f"w{i}" for i in range(n)])
    before = _owners(ring)
    ring.remove("w0")
    after = _owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert set(moved) == {k for k in KEYS if before[k] == "w0"}
    expected = 1 / n
    assert abs(len(moved) / len(KEYS) - expected) < 0.35 * expected
    ring.add("w0")
    assert _owners(ring) == before  # rejoining restores every key's owner


def test_walk_visits_each_worker_once_starting_with_the_owner():
    ring = HashRing(["a", "b", "c"])
    for key in KEYS[:200]:
        order = list(ring.walk(key))
        assert sorted(order) == ["a", "b", "c"] and order[0] == ring.lookup(key)


def test_unit_fraction_is_stable_and_spread():
    values = [unit_fraction(k) for k in KEYS]
    assert values == [unit_fraction(k) for k in KEYS]
    assert all(0 <= v < 1 for v in values)
    assert abs(sum(v < 0.3 for v in values) / len(values) - 0.3) < 0.03
