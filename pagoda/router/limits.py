"""The gateway's limits: token-bucket QPS overall and per API key, and a bound on requests in
flight. Past any of them a request is refused at once with 429 and `Retry-After`, before it
reaches a replica: a burst beyond what the cluster holds is shed at the door instead of
queueing without bound (the replicas' own `--max-num-seqs` / `--max-queue-len` are the second
level).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from pagoda.router.workers import Clock

MAX_TRACKED_KEYS = 10_000  # per-key buckets kept; the least recently used beyond that are dropped


class TokenBucket:
    """`rate` tokens a second, holding at most `burst` (default: one second's worth, at least 1)."""

    def __init__(self, rate: float, burst: float | None = None, clock: Clock = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"a token bucket's rate must be positive, got {rate}")
        self.rate = rate
        self.capacity = burst if burst is not None else max(1.0, rate)
        self.clock = clock
        self.tokens = self.capacity
        self._updated = clock()

    def take(self) -> float:
        """Take a token: 0.0 if there was one, else the seconds until there will be."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._updated) * self.rate)
        self._updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def give_back(self) -> None:
        """Return a token taken for a request that another limit refused."""
        self.tokens = min(self.capacity, self.tokens + 1.0)


@dataclass(frozen=True)
class Rejection:
    level: str  # "in_flight" | "key_qps" | "global_qps"
    retry_after: float  # seconds

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))

    @property
    def message(self) -> str:
        return {"in_flight": "the router has too many requests in flight",
                "key_qps": "rate limit reached for this API key",
                "global_qps": "rate limit reached for the service"}[self.level] + \
            f"; retry after {self.retry_after_header} s"


class GatewayLimits:
    """Admits a request (taking an in-flight slot) or says which limit refused it."""

    def __init__(self, qps: float | None = None, qps_per_key: float | None = None,
                 max_in_flight: int | None = None, clock: Clock = time.monotonic) -> None:
        self.qps_per_key, self.max_in_flight, self.clock = qps_per_key, max_in_flight, clock
        self.overall = TokenBucket(qps, clock=clock) if qps else None
        self._per_key: OrderedDict[str, TokenBucket] = OrderedDict()
        self.in_flight = 0

    def admit(self, api_key: str) -> Rejection | None:
        """None and one slot taken (give it back with `release`), or the refusal."""
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            return Rejection("in_flight", 1.0)
        key_bucket = self._bucket(api_key)
        if key_bucket is not None and (wait := key_bucket.take()) > 0:
            return Rejection("key_qps", wait)
        if self.overall is not None and (wait := self.overall.take()) > 0:
            if key_bucket is not None:
                key_bucket.give_back()
            return Rejection("global_qps", wait)
        self.in_flight += 1
        return None

    def release(self) -> None:
        self.in_flight -= 1

    def _bucket(self, api_key: str) -> TokenBucket | None:
        if not self.qps_per_key:
            return None
        bucket = self._per_key.get(api_key)
        if bucket is None:
            bucket = self._per_key[api_key] = TokenBucket(self.qps_per_key, clock=self.clock)
            if len(self._per_key) > MAX_TRACKED_KEYS:
                self._per_key.popitem(last=False)
        else:
            self._per_key.move_to_end(api_key)
        return bucket
