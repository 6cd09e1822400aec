"""The radix tree on its own: match, node splits, insert, locks, LRU eviction, salts."""

from __future__ import annotations

from pagoda.core.radix_cache import RadixCache

BS = 4


def toks(*blocks: int) -> list[int]:
    """Tokens of whole blocks: block k is [k*10, k*10+1, k*10+2, k*10+3]."""
    return [b * 10 + i for b in blocks for i in range(BS)]


def test_match_empty_and_partial_blocks_do_not_count():
    cache = RadixCache(BS)
    assert cache.match(toks(1, 2)).blocks == []
    assert cache.insert(toks(1, 2) + [99, 98], [100, 101, 102])[0] == 0  # the partial third block is not stored
    assert cache.num_cached_blocks == 2
    assert cache.match(toks(1, 2)).blocks == [100, 101]
    assert cache.match(toks(1) + [10, 11]).blocks == [100]  # a partial block never matches


def test_match_across_a_node_split():
    cache = RadixCache(BS)
    cache.insert(toks(1, 2, 3), [100, 101, 102])
    m = cache.match(toks(1, 2, 7))  # diverges inside the node: split after two blocks
    assert m.blocks == [100, 101]
    assert cache.match(toks(1, 2, 3)).blocks == [100, 101, 102]
    assert cache.insert(toks(1, 2, 7, 8), [200, 201, 202, 203])[0] == 2  # shares two blocks
    assert cache.match(toks(1, 2, 7, 8)).blocks == [100, 101, 202, 203]
    assert cache.num_cached_blocks == 5


def test_insert_reports_blocks_already_cached_under_other_ids():
    cache = RadixCache(BS)
    cache.insert(toks(1, 2), [100, 101])
    # another request computed the same prefix in its own blocks: the tree keeps its own
    assert cache.insert(toks(1, 2, 3), [300, 301, 302])[0] == 2
    assert cache.match(toks(1, 2, 3)).blocks == [100, 101, 302]


def test_locked_nodes_are_not_evicted_and_lru_order():
    cache = RadixCache(BS)
    cache.insert(toks(1, 2), [100, 101])  # a
    cache.insert(toks(3), [102])  # b
    cache.insert(toks(4), [103])  # c
    cache.match(toks(3))  # b used recently: a is now least recently used
    locked = cache.match(toks(4))
    cache.lock(locked.node)
    assert cache.num_evictable_blocks == 3
    assert cache.evict(1) == [100, 101]  # LRU leaf first, whole node
    assert cache.evict(5) == [102]  # c is locked
    assert cache.match(toks(4)).blocks == [103]
    cache.unlock(locked.node)
    assert cache.num_evictable_blocks == 1
    assert cache.evict(5) == [103] and cache.num_cached_blocks == 0


def test_eviction_walks_up_to_parents_that_become_leaves():
    cache = RadixCache(BS)
    cache.insert(toks(1, 2), [100, 101])
    cache.insert(toks(1, 3), [100, 102])  # splits after block 1: parent [100], children [101], [102]
    assert sorted(cache.evict(3)) == [100, 101, 102]
    assert cache.num_cached_blocks == 0 and cache.num_evictable_blocks == 0


def test_salts_keep_tenants_apart():
    cache = RadixCache(BS)
    cache.insert(toks(1, 2), [100, 101], salt="alice")
    assert cache.match(toks(1, 2), salt="bob").blocks == []
    assert cache.match(toks(1, 2)).blocks == []
    assert cache.match(toks(1, 2), salt="alice").blocks == [100, 101]


def _shape(cache: RadixCache) -> list[tuple]:
    """Every node (tokens, blocks, lock count), depth first in key order: the tree to compare."""
    out = []

    def walk(node, depth):
        for key in sorted(node.children):
            child = node.children[key]
            out.append((depth, child.tokens, tuple(child.blocks), child.lock_ref))
            walk(child, depth + 1)

    for salt in sorted(cache._roots, key=repr):
        walk(cache._roots[salt], 0)
    return out


def test_extend_from_a_locked_node_equals_insert_from_the_root():
    """A running request stores its blocks as they fill: extending from the node it holds must
    leave the tree, the counts, the 'already cached' answer and the locks as inserting its whole
    run from the root and moving its lock would, also where another request stored the same
    tokens meanwhile and where the node it holds was split under it."""
    results = []
    for incremental in (False, True):
        cache = RadixCache(BS)
        other = cache.insert(toks(1, 2, 3, 4, 5), [200, 201, 202, 203, 204])[1]
        cache.lock(other)
        run, ids = toks(1, 2, 3, 4, 5, 6, 7, 8), [100, 101, 102, 103, 104, 105, 106, 107]
        answers = []
        held = cache.insert(run[: 2 * BS], ids[:2])[1]  # the request's first two blocks (shared)
        cache.lock(held)
        done = 2
        cache.match(toks(1, 9))  # splits the path under the held node's ancestors
        for full in (3, 6, 8):
            if incremental:
                have, node = cache.extend(held, done, run[: full * BS], ids[:full])
                cache.relock(held, node)
            else:
                have, node = cache.insert(run[: full * BS], ids[:full])
                cache.lock(node)
                cache.unlock(held)
            answers.append(have)
            held, done = node, full
        results.append((answers, _shape(cache), cache.num_cached_blocks, cache.num_evictable_nodes_blocks,
                        cache.match(run).blocks))
    assert results[0] == results[1]
    answers, _, cached, evictable, blocks = results[1]
    assert answers == [3, 5, 6]  # blocks 1-5 were stored by the other request, 6-8 are new
    assert blocks == [200, 201, 202, 203, 204, 105, 106, 107] and cached == 8 and evictable == 0
