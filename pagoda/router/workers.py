"""The router's workers (`pagoda serve` replicas): their health, load and warm-up.

A worker takes requests while it is *available*: its last health probe passed and its circuit
breaker lets requests through. Two sources of truth feed that:

- active probes: `GET /health` on every worker each `--health-interval` seconds. A refused
  connection or a non-200 answer (a replica that is draining, restarting or whose engine died
  answers 503) takes the worker out at once; a probe that times out must do so twice in a row,
  so one slow answer from a busy replica does not;
- passive failures: a request the worker did not answer (connection refused or reset, timeout,
  502/503/504) counts against its circuit breaker; a refused connection also marks it down at
  once, so the next request does not try it again.

A worker that becomes available again (it joined, or it recovered) is *warming up*: its weight
ramps from `MIN_WEIGHT` to 1 over `--warmup-seconds`, and the policies give it that part of
its share, so a cold replica (empty prefix cache, kernels not yet hot) is not handed a full
share of sessions in one go.

A replica that loads its model layer by layer (`pagoda serve --progressive-load`) says so on its
`/health` (`X-Pagoda-Loading: 7/16`): with the default `--ready-when loaded` it answers 503 and is
down, with the reason, until every layer is in place; with `--ready-when serving` it answers 200
and takes requests, but its ramp stays at `MIN_WEIGHT` until it is loaded, so it gets a trickle of
requests that wait for its layers rather than a growing share.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger("pagoda.router")

Clock = Callable[[], float]
MIN_WEIGHT = 0.1  # a warming worker's weight at the start of its ramp
PROBE_TIMEOUTS_BEFORE_DOWN = 2
# a replica loading its model layer by layer says how far it is (pagoda/entrypoints/openai/loading.py)
LOADING_HEADER = "X-Pagoda-Loading"


class BreakerState(str, enum.Enum):
    CLOSED = "closed"  # requests flow
    OPEN = "open"  # the worker kept failing: no requests until `open_seconds` have passed
    HALF_OPEN = "half_open"  # one trial request is let through; its outcome closes or reopens


@dataclass
class CircuitBreaker:
    """Stops sending requests to a worker after `failure_threshold` failures in a row, and
    tries it again with a single request `open_seconds` later."""

    failure_threshold: int = 3
    open_seconds: float = 10.0
    clock: Clock = time.monotonic
    consecutive_failures: int = 0
    _state: BreakerState = BreakerState.CLOSED
    _opened_at: float = 0.0
    _trial_in_flight: bool = False

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self.clock() - self._opened_at >= self.open_seconds:
            self._state, self._trial_in_flight = BreakerState.HALF_OPEN, False
        return self._state

    def allows_request(self) -> bool:
        """Whether a request may be sent now (asks only; `on_dispatch` takes the trial slot)."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def on_dispatch(self) -> bool:
        """Note a request sent; True if it is the half-open state's trial."""
        if self.state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def abandon_trial(self) -> None:
        """The trial request ended with no verdict (its client left): let another one try."""
        self._trial_in_flight = False

    def record_success(self) -> None:
        self._state, self.consecutive_failures, self._trial_in_flight = BreakerState.CLOSED, 0, False

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        self._trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self._state, self._opened_at = BreakerState.OPEN, self.clock()


@dataclass(eq=False)  # compared and hashed by identity: one object per registered worker
class Worker:
    """One replica as the router sees it."""

    url: str
    breaker: CircuitBreaker
    warmup_seconds: float = 0.0
    clock: Clock = time.monotonic
    healthy: bool = False
    in_flight: int = 0  # requests the router has sent and not yet seen finish
    requests: int = 0
    failures: int = 0
    # When the worker last became healthy; None while it is down. -inf: full weight at once
    # (the workers the router starts with are not warmed up against each other).
    ready_since: float | None = None
    probe_timeouts: int = 0
    down_reason: str = "not probed yet"  # why it is down (its state in logs and "no worker" errors)
    probed: bool = False  # its first health verdict is logged whichever it is
    # "<layers in place>/<layers>" while its model loads layer by layer (its /health's
    # X-Pagoda-Loading header); None once loaded
    loading: str | None = None

    @property
    def available(self) -> bool:
        return self.healthy and self.breaker.allows_request()

    def weight(self) -> float:
        """The part of its full share this worker gets now: 0 while down, ramping from
        MIN_WEIGHT to 1 over the warm-up window after it became healthy."""
        if not self.healthy or self.ready_since is None:
            return 0.0
        if self.warmup_seconds <= 0:
            return 1.0
        ramp = (self.clock() - self.ready_since) / self.warmup_seconds
        return min(1.0, max(MIN_WEIGHT, ramp))

    def mark_up(self, *, warm: bool = True) -> None:
        if not self.healthy:
            self.healthy, self.probed = True, True
            self.ready_since = self.clock() if warm else float("-inf")
            logger.info("worker %s is up%s", self.url, " (warming up)" if warm and self.warmup_seconds > 0 else "")

    def mark_down(self, reason: str) -> None:
        """Logged when it goes down, and at its first probe: a worker that never answers is named
        in the log from the start, not only through the requests it cannot take."""
        if self.healthy or not self.probed:
            logger.warning("worker %s is down: %s (no requests go to it until its /health answers 200)",
                           self.url, reason)
        self.healthy, self.ready_since, self.probed, self.down_reason = False, None, True, reason

    def state(self) -> str:
        """Why it takes requests or not, in words: "available", "down: <reason>", "circuit breaker open"..."""
        if not self.healthy:
            return f"down: {self.down_reason}"
        breaker = self.breaker.state
        if breaker is BreakerState.OPEN:
            return f"circuit breaker open after {self.breaker.consecutive_failures} failure(s)"
        if not self.breaker.allows_request():
            return "circuit breaker half-open, its trial request in flight"
        return "available"

    def describe(self) -> dict:
        """The worker's state for `GET /workers`."""
        return {"url": self.url, "healthy": self.healthy, "available": self.available,
                "in_flight": self.in_flight, "weight": round(self.weight(), 3),
                "breaker": self.breaker.state.value, "consecutive_failures": self.breaker.consecutive_failures,
                "requests": self.requests, "failures": self.failures, "loading": self.loading}


def normalize_url(url: str) -> str:
    """`http://host:port` without a trailing slash; refuses anything that is not http(s)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"a worker URL must look like http://HOST:PORT, got {url!r}")
    return url


@dataclass
class WorkerRegistry:
    """The workers by URL, and the probes that keep their health current."""

    warmup_seconds: float = 30.0
    failure_threshold: int = 3
    breaker_open_seconds: float = 10.0
    probe_timeout: float = 2.0
    clock: Clock = time.monotonic
    workers: dict[str, Worker] = field(default_factory=dict)

    def add(self, url: str) -> Worker:
        url = normalize_url(url)
        if url not in self.workers:
            breaker = CircuitBreaker(self.failure_threshold, self.breaker_open_seconds, clock=self.clock)
            self.workers[url] = Worker(url, breaker, warmup_seconds=self.warmup_seconds, clock=self.clock)
        return self.workers[url]

    def remove(self, url: str) -> Worker | None:
        return self.workers.pop(normalize_url(url), None)

    def get(self, url: str) -> Worker | None:
        return self.workers.get(url)

    def available(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers.values() if w.available and w.url not in exclude]

    def why_none_available(self) -> str:
        """Each worker and its state, for the "no worker is available" answer."""
        if not self.workers:
            return "the router has no workers (give --worker URL, or add one with POST /workers)"
        return "; ".join(f"{w.url} ({w.state()})" for w in self.workers.values())

    def record_success(self, worker: Worker) -> None:
        worker.breaker.record_success()

    def record_failure(self, worker: Worker, error: str, *, refused: bool = False) -> None:
        """A request `worker` did not answer. A refused connection means nothing listens there:
        the worker is down until a probe says otherwise."""
        worker.failures += 1
        worker.breaker.record_failure()
        if refused:
            worker.mark_down(error)

    async def probe(self, worker: Worker, client: httpx.AsyncClient, *, warm: bool = True) -> bool:
        """One `GET /health`; updates and returns the worker's health."""
        try:
            response = await client.get(f"{worker.url}/health", timeout=self.probe_timeout)
        except httpx.TimeoutException:
            worker.probe_timeouts += 1
            if worker.probe_timeouts >= PROBE_TIMEOUTS_BEFORE_DOWN or not worker.probed:  # never up: say so now
                worker.mark_down(f"health probe timed out ({self.probe_timeout:g}s)")
            return worker.healthy
        except httpx.HTTPError as e:
            worker.mark_down(f"health probe failed: {type(e).__name__}")
            return False
        loading = response.headers.get(LOADING_HEADER)
        worker.loading = loading
        if response.status_code == 200:
            worker.probe_timeouts = 0
            worker.mark_up(warm=warm)
            if loading is not None and warm:  # `--ready-when serving`: up, but its ramp starts once loaded
                worker.ready_since = self.clock()
        elif loading is not None:
            worker.mark_down(f"loading its model ({loading} layers in place)")
        else:
            worker.mark_down(f"health probe answered {response.status_code}")
        return worker.healthy

    async def probe_all(self, client: httpx.AsyncClient, *, warm: bool = True) -> None:
        await asyncio.gather(*(self.probe(w, client, warm=warm) for w in list(self.workers.values())))

    async def probe_forever(self, client: httpx.AsyncClient, interval: float) -> None:
        """The active health checks, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.probe_all(client)
            except Exception:  # a bug here must not stop the probes for good
                logger.exception("health probes failed")
