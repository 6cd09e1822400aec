"""Routing policies: which available worker gets a request, and why.

Every policy answers `choose(request, candidates)` with a `Decision` (the worker and the reason,
which `/metrics` counts) and hears `routed(request, worker)` once the request went out. The
candidates are the available workers not yet tried for this request; the router never calls
`choose` with none. Warm-up enters through `Worker.weight()`:

- `round_robin`: smooth weighted round robin (nginx's): with equal weights, strict rotation; a
  warming worker's turns come at the rate of its weight.
- `least_load`: fewest requests in flight per unit of weight; ties rotate.
- `consistent_hash`: the session key on a hash ring (`HashRing`). A warming worker takes a key
  only if the key's fixed fraction is below its weight, so the keys it takes over grow with the
  ramp and, once taken, stay; the others fall through to the next worker on the ring.
- `cache_aware` (SGLang router): explicit session keys stick (`consistent_hash`). Otherwise, if
  the load is too uneven (max - min in flight above `balance_abs_threshold` and max above
  `balance_rel_threshold` x min), the least-loaded worker. Otherwise the worker whose prompts
  share the longest prefix with this one (`PrefixTree`), if that prefix is at least
  `cache_threshold` of the prompt, else the least-loaded. With the workers' KV events
  (`--kv-events`, kv_index.py) the exact match comes first: the worker whose prefix cache holds
  the most of the prompt's leading blocks, if that is at least `cache_threshold` of the prompt
  ("kv_prefix"); the tree still answers while the events of a prefix just routed are on their way.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pagoda.router import POLICIES
from pagoda.router.affinity import RouteRequest
from pagoda.router.hash_ring import HashRing, unit_fraction
from pagoda.router.kv_index import KVBlockIndex
from pagoda.router.prefix_tree import DEFAULT_MAX_CHARS_PER_WORKER, PrefixTree
from pagoda.router.workers import Worker


@dataclass(frozen=True)
class Decision:
    worker: Worker
    reason: str  # "session" | "hash" | "kv_prefix" | "prefix" | "load" | "round_robin"
    matched_chars: int = 0
    matched_tokens: int = 0  # "kv_prefix": the prompt's tokens the worker's prefix cache holds


class Policy:
    """The interface; `add_worker` / `remove_worker` keep per-worker state (rings, trees)."""

    name = "policy"

    def add_worker(self, url: str) -> None:
        pass

    def remove_worker(self, url: str) -> None:
        pass

    def choose(self, request: RouteRequest, candidates: list[Worker]) -> Decision:
        raise NotImplementedError

    def routed(self, request: RouteRequest, worker: Worker) -> None:
        pass


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def remove_worker(self, url: str) -> None:
        self._current.pop(url, None)

    def choose(self, request: RouteRequest, candidates: list[Worker]) -> Decision:
        total = 0.0
        best: Worker | None = None
        for w in candidates:
            weight = w.weight()
            total += weight
            self._current[w.url] = self._current.get(w.url, 0.0) + weight
            if best is None or self._current[w.url] > self._current[best.url]:
                best = w
        assert best is not None
        self._current[best.url] -= total
        return Decision(best, "round_robin")


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: list[Worker]) -> Worker:
        """The worker with the fewest requests in flight per unit of weight; the scan starts
        one further each call, so ties (an idle cluster) rotate instead of piling on one."""
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda w: (w.in_flight + 1) / max(w.weight(), 1e-9))

    def choose(self, request: RouteRequest, candidates: list[Worker]) -> Decision:
        return Decision(self.pick(candidates), "load")


class ConsistentHash(Policy):
    name = "consistent_hash"

    def __init__(self, vnodes: int | None = None) -> None:
        self.ring = HashRing() if vnodes is None else HashRing(vnodes=vnodes)

    def add_worker(self, url: str) -> None:
        self.ring.add(url)

    def remove_worker(self, url: str) -> None:
        self.ring.remove(url)

    def choose(self, request: RouteRequest, candidates: list[Worker]) -> Decision:
        reason = "session" if request.session_key is not None else "hash"
        by_url = {w.url: w for w in candidates}
        fraction = unit_fraction(request.key)
        fallback: Worker | None = None
        for url in self.ring.walk(request.key):
            worker = by_url.get(url)
            if worker is None:  # down, excluded, or its breaker is open: the next one on the ring
                continue
            if fraction < worker.weight():
                return Decision(worker, reason)
            fallback = fallback or worker
        # every candidate is warming up and none admits this key: the first of them on the ring
        return Decision(fallback or candidates[0], reason)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 16,
                 balance_rel_threshold: float = 1.5, max_chars_per_worker: int = DEFAULT_MAX_CHARS_PER_WORKER,
                 kv_index: KVBlockIndex | None = None) -> None:
        self.kv_index = kv_index
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_chars_per_worker)
        self.sessions = ConsistentHash()
        self.least_load = LeastLoad()

    def add_worker(self, url: str) -> None:
        self.sessions.add_worker(url)

    def remove_worker(self, url: str) -> None:
        self.sessions.remove_worker(url)
        self.tree.remove_worker(url)

    def imbalanced(self, candidates: list[Worker]) -> bool:
        loads = [w.in_flight for w in candidates]
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def choose(self, request: RouteRequest, candidates: list[Worker]) -> Decision:
        if request.session_key is not None:
            return self.sessions.choose(request, candidates)
        if self.imbalanced(candidates):
            return Decision(self.least_load.pick(candidates), "load")
        exact = self._kv_prefix(request, candidates)
        if exact is not None:
            return exact
        text = request.prompt_text
        matched = self.tree.match(text)
        best = max(candidates, key=lambda w: (matched.get(w.url, 0), -w.in_flight))
        length = matched.get(best.url, 0)
        if text and length / len(text) >= self.cache_threshold:
            return Decision(best, "prefix", length)
        return Decision(self.least_load.pick(candidates), "load", length)

    def _kv_prefix(self, request: RouteRequest, candidates: list[Worker]) -> Decision | None:
        tokens = request.prompt_tokens
        if self.kv_index is None or not tokens:
            return None
        matched = self.kv_index.match(tokens, [w.url for w in candidates])
        best = max(candidates, key=lambda w: (matched[w.url], -w.in_flight))
        held = matched[best.url]
        if held and held / len(tokens) >= self.cache_threshold:
            return Decision(best, "kv_prefix", matched_tokens=held)
        return None

    def routed(self, request: RouteRequest, worker: Worker) -> None:
        if request.prompt_text:
            self.tree.insert(request.prompt_text, worker.url)


def make_policy(name: str, **cache_aware_options) -> Policy:
    if name == "cache_aware":
        return CacheAware(**cache_aware_options)
    if name == "consistent_hash":
        return ConsistentHash()
    if name == "least_load":
        return LeastLoad()
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
