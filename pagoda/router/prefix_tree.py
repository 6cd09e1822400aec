"""An approximate record of which prompt prefixes each worker has seen (SGLang router's idea).

The router cannot ask a replica what its prefix cache holds, but it knows every prompt it sent
there. It keeps them in one radix tree over characters whose nodes carry the workers ("tenants")
that were sent a prompt through that node, with the time (a counter) of the last such prompt.
A new prompt then walks the tree: the deepest node a worker tenants tells how many leading
characters of the prompt that worker has probably cached.

"Approximate": the replicas evict their caches on their own, the text is the prompt as the
router sees it (not tokens), and the tree forgets too: each worker may hold at most
`max_chars_per_worker` characters here; past that, its least recently used leaves are dropped.

Invariant: a node's tenants are a subset of its parent's (insert adds a worker along the whole
path; eviction removes a worker only from nodes where no child holds it), so a match can take
the tenants of each node on the path as it goes down.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

DEFAULT_MAX_CHARS_PER_WORKER = 2_000_000
EVICT_TO = 0.9  # evict down to this part of the bound, so eviction is not rerun on every insert


class _Node:
    __slots__ = ("text", "children", "tenants", "parent")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text  # the edge label from the parent
        self.children: dict[str, _Node] = {}  # first character of the child's text -> child
        self.tenants: dict[str, int] = {}  # worker -> tick of its last prompt through here
        self.parent = parent


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """Prompt prefixes per worker, bounded per worker with LRU eviction of leaves."""

    def __init__(self, max_chars_per_worker: int = DEFAULT_MAX_CHARS_PER_WORKER) -> None:
        self.max_chars_per_worker = max_chars_per_worker
        self._root = _Node("", None)
        self._chars: defaultdict[str, int] = defaultdict(int)  # characters each worker tenants
        self._tick = 0

    def chars(self, worker: str) -> int:
        """How many characters of prefixes the tree holds for `worker`."""
        return self._chars.get(worker, 0)

    def insert(self, text: str, worker: str) -> None:
        """Record that `worker` was sent a prompt starting with `text`."""
        self._tick += 1
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node)
                leaf.tenants[worker] = self._tick
                node.children[text[i]] = leaf
                self._chars[worker] += len(leaf.text)
                break
            common = _common_prefix_len(child.text, text[i:])
            if common < len(child.text):
                child = self._split(child, common)
            if worker not in child.tenants:
                self._chars[worker] += len(child.text)
            child.tenants[worker] = self._tick
            node, i = child, i + len(child.text)
        if self._chars[worker] > self.max_chars_per_worker:
            self._evict(worker, int(self.max_chars_per_worker * EVICT_TO))

    def match(self, text: str) -> dict[str, int]:
        """For each worker that shares a prefix with `text`: the length of that prefix."""
        matched: dict[str, int] = {}
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            common = _common_prefix_len(child.text, text[i:])
            for worker in child.tenants:
                matched[worker] = i + common
            if common < len(child.text):
                break
            node, i = child, i + common
        return matched

    def remove_worker(self, worker: str) -> None:
        """Forget everything `worker` was sent (it left the router)."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.tenants.pop(worker, None) is not None:
                stack.extend(node.children.values())
                self._prune(node)
        self._chars.pop(worker, None)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` characters; returns the new upper part."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.text[:at], parent)
        upper.tenants = dict(node.tenants)
        parent.children[upper.text[0]] = upper
        node.text = node.text[at:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper

    def _evict(self, worker: str, target: int) -> None:
        """Drop `worker` from its least recently used leaves until it holds at most `target`
        characters. A parent whose last child of this worker goes becomes a leaf in turn."""
        heap = [(n.tenants[worker], id(n), n) for n in self._leaves_of(worker)]
        heapq.heapify(heap)
        while heap and self._chars[worker] > target:
            _, _, node = heapq.heappop(heap)
            del node.tenants[worker]
            self._chars[worker] -= len(node.text)
            parent = node.parent
            self._prune(node)
            if parent is not None and parent is not self._root and worker in parent.tenants \
                    and not any(worker in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[worker], id(parent), parent))

    def _leaves_of(self, worker: str) -> list[_Node]:
        """The nodes `worker` tenants none of whose children it tenants."""
        leaves, stack = [], [c for c in self._root.children.values() if worker in c.tenants]
        while stack:
            node = stack.pop()
            mine = [c for c in node.children.values() if worker in c.tenants]
            if mine:
                stack.extend(mine)
            else:
                leaves.append(node)
        return leaves

    def _prune(self, node: _Node) -> None:
        """Remove `node` (and then its parents) from the tree while it has neither tenants nor
        children."""
        while node is not self._root and not node.tenants and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.text[0]]
            node = parent
