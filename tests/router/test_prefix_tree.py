"""The approximate prefix tree: per-worker match lengths, splits, bounded size with LRU eviction."""

from __future__ import annotations

from pagoda.router.prefix_tree import PrefixTree


def test_match_reports_each_workers_longest_prefix():
    tree = PrefixTree()
    tree.insert("system: be brief. user: hello", "a")
    tree.insert("system: be brief. user: goodbye", "b")
    tree.insert("other", "b")
    got = tree.match("system: be brief. user: help me")
    assert got == {"a": len("system: be brief. user: hel"), "b": len("system: be brief. user: ")}
    assert tree.match("zzz") == {}
    assert tree.match("") == {}
    assert tree.match("oth") == {"b": 3}


def test_a_prompt_matches_itself_fully_and_extensions_match_their_stem():
    tree = PrefixTree()
    turn1 = "user: hi\nassistant: hello\n"
    tree.insert(turn1, "w")
    assert tree.match(turn1) == {"w": len(turn1)}
    assert tree.match(turn1 + "user: and now?") == {"w": len(turn1)}


def test_chars_are_counted_once_per_worker_across_splits():
    tree = PrefixTree()
    tree.insert("abcdef", "a")
    tree.insert("abcxyz", "a")  # splits "abcdef" at "abc"
    assert tree.chars("a") == len("abcdef") + len("xyz")
    tree.insert("abcdef", "b")
    assert tree.chars("b") == 6 and tree.chars("a") == 9


def test_eviction_keeps_the_bound_and_drops_least_recently_used_first():
    tree = PrefixTree(max_chars_per_worker=100)
    prompts = [letter * 20 for letter in "abcdefghij"]  # 20 chars each, nothing shared
    for prompt in prompts:
        tree.insert(prompt, "w")
    assert tree.chars("w") <= 100
    assert tree.match(prompts[-1]) == {"w": 20}  # the most recent survive
    assert tree.match(prompts[0]) == {}  # the oldest went first
    tree.insert("v" * 20, "v")  # another worker's entries do not count against w's bound
    tree.insert(prompts[-1], "v")
    assert tree.match(prompts[-1]) == {"w": 20, "v": 20}


def test_sending_a_prefix_again_makes_it_recent():
    tree = PrefixTree(max_chars_per_worker=60)
    a, b, c, d = (letter * 20 for letter in "abcd")
    for prompt in (a, b, c, a):  # a is sent again: now b is the least recently used
        tree.insert(prompt, "w")
    tree.insert(d, "w")  # 80 chars: evict down to 54
    assert {p[0] for p in (a, b, c, d) if tree.match(p)} == {"a", "d"}


def test_eviction_of_a_leaf_leaves_the_shared_stem():
    tree = PrefixTree(max_chars_per_worker=30)
    tree.insert("stem-" + "a" * 10, "w")
    tree.insert("stem-" + "b" * 10, "w")
    tree.insert("stem-" + "c" * 10, "w")  # 35 chars: evicts the oldest leaf ("a...")
    assert tree.chars("w") <= 30
    assert tree.match("stem-" + "a" * 10) == {"w": 5}
    assert tree.match("stem-" + "c" * 10) == {"w": 15}


def test_remove_worker_forgets_it_and_prunes():
    tree = PrefixTree()
    tree.insert("shared prefix one", "a")
    tree.insert("shared prefix two", "b")
    tree.remove_worker("a")
    assert tree.match("shared prefix one") == {"b": len("shared prefix ")}
    assert tree.chars("a") == 0
    tree.remove_worker("b")
    assert tree.match("shared prefix two") == {} and not tree._root.children
