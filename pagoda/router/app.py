"""`pagoda router`: an OpenAI-compatible front for several `pagoda serve` replicas.

A request goes through, in order: the gateway limits (429 at once past them), the routing
policy (which available worker), the worker (httpx, one shared connection pool), and back.

- Retry: a request that failed before any byte went to the client (the worker refused the
  connection, timed out, answered 502/503/504, or died before answering / before its stream's
  first bytes) is tried once more on another worker. A non-streaming answer is read whole
  before it is sent on, so a worker dying mid-generation costs the client a retry, not an error.
- A stream that breaks after bytes went out cannot be retried: it ends with an SSE error event
  and `data: [DONE]` (proxy.RelayResponse).
- Every answer carries `x-pagoda-worker`, the URL of the worker that gave it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from collections.abc import Coroutine
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagoda.entrypoints.disconnect import GONE, unless_disconnected
from pagoda.router.homes import LISTS, Homes, created_id, merged_list, named_thing
from pagoda.router.affinity import (
    SESSION_HEADER, SESSIONS_PATH, RouteRequest, new_session_id, route_request, session_in_path,
)
from pagoda.router.disaggregation import PREFILL_HEADER, PrefillStage
from pagoda.router.discovery import DnsDiscovery
from pagoda.router.config import RouterConfig
from pagoda.router.forecast import LoadForecaster, requested_tokens
from pagoda.router.kv_routing import KVRouting
from pagoda.router.limits import GatewayLimits
from pagoda.router.prometheus import RouterMetrics
from pagoda.router.policies import Decision, Policy, make_policy
from pagoda.router.proxy import (
    WORKER_HEADER, BodyTooLarge, OpenAIErrorResponse, RelayResponse, answer_headers, bearer_token, forward_headers,
    is_event_stream, parse_json, read_body, read_raw, workers_models,
)
from pagoda.router.workers import BreakerState, Worker, WorkerRegistry

logger = logging.getLogger("pagoda.router")

MAX_ATTEMPTS = 2  # the first worker, and one retry elsewhere
RETRYABLE_STATUS = frozenset({502, 503, 504})  # the worker could not take it; another may
MODELS_TIMEOUT = 10.0  # seconds for a worker's /v1/models (a hung worker must not hang the list)


@dataclass
class _Failure:
    """An attempt that another worker may redo; `answer` is the worker's own error response, if
    it gave one (passed on when there is no other worker to try)."""

    reason: str
    answer: Response | None = None


class _Lease:
    """One request's count in a worker's `in_flight`, given back exactly once."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.held = worker, True
        worker.in_flight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.worker.in_flight -= 1


class Router:
    """The router's state (workers, policy, limits, metrics) and the forwarding of requests."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = WorkerRegistry(warmup_seconds=config.warmup_seconds, failure_threshold=config.breaker_failures,
                                       breaker_open_seconds=config.breaker_open_seconds,
                                       probe_timeout=max(1.0, min(config.health_interval, 5.0)))
        self.kv = KVRouting.of(config.kv_events, config.kv_events_port, config.tokenizer)
        self.policy: Policy = make_policy(config.policy, **self._cache_aware_options())
        self.homes = Homes()  # where stored responses, files and batch jobs live (homes.py)
        self.limits = GatewayLimits(config.qps, config.qps_per_key, config.max_requests_in_flight)
        self.forecaster = LoadForecaster(config.forecast)  # the load ahead, for autoscalers (/metrics)
        self.metrics = RouterMetrics(lambda: list(self.registry.workers.values()), self.forecaster,
                                     self.kv.index if self.kv else None)
        self.client: httpx.AsyncClient | None = None
        self._background: list[asyncio.Task] = []  # the health probes, and discovery with --discover
        self.discovery = DnsDiscovery(config.discover, self._discovered, self.remove_worker)
        self.streams: set[RelayResponse] = set()  # open relays, ended with an error event at shutdown
        self._forwarding: set[asyncio.Task] = set()  # requests waiting on a worker, answered 503 at shutdown
        self.ending: str | None = None  # set by abort_all: why requests in flight end
        for url in config.workers:
            self.add_worker(url)
        self.prefill: PrefillStage | None = None
        if config.prefill_workers is not None:
            self.prefill = PrefillStage(config.prefill_workers, WorkerRegistry(
                warmup_seconds=0.0, failure_threshold=config.breaker_failures,
                breaker_open_seconds=config.breaker_open_seconds, probe_timeout=self.registry.probe_timeout))

    def _cache_aware_options(self) -> dict[str, Any]:
        c = self.config
        if c.policy != "cache_aware":
            return {}
        return {"cache_threshold": c.cache_threshold, "balance_abs_threshold": c.balance_abs_threshold,
                "balance_rel_threshold": c.balance_rel_threshold, "kv_index": self.kv.index if self.kv else None}

    # --- workers ---------------------------------------------------------------------------

    def add_worker(self, url: str) -> Worker:
        worker = self.registry.add(url)
        self.policy.add_worker(worker.url)
        if self.kv is not None:
            self.kv.subscriber.add(worker.url)
        return worker

    def remove_worker(self, url: str) -> bool:
        worker = self.registry.remove(url)
        if worker is not None:
            self.policy.remove_worker(worker.url)
            self.homes.forget_worker(worker.url)
            if self.kv is not None:
                self.kv.subscriber.remove(worker.url)
        return worker is not None

    async def _discovered(self, url: str) -> None:
        assert self.client is not None
        await self.registry.probe(self.add_worker(url), self.client)  # warm-up starts once it answers

    async def start(self) -> None:
        """Open the connection pool, learn the workers' health (at full weight: the workers the
        router starts with are not warmed up against each other), then probe on the interval."""
        timeout = httpx.Timeout(connect=self.config.connect_timeout, read=self.config.request_timeout,
                                write=60.0, pool=None)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                             max_keepalive_connections=256))
        if self.kv is not None:
            self.kv.subscriber.start()
        await self.registry.probe_all(self.client, warm=False)
        if self.prefill is not None:
            await self.prefill.registry.probe_all(self.client, warm=False)
            self._background.append(asyncio.create_task(
                self.prefill.registry.probe_forever(self.client, self.config.health_interval)))
        await self.discovery.sync()
        available, total = len(self.registry.available()), len(self.registry.workers)
        if available < total:
            logger.warning("%d of %d worker(s) available at start", available, total)
        self._background.append(asyncio.create_task(self.registry.probe_forever(self.client,
                                                                                self.config.health_interval)))
        if self.config.discover:
            self._background.append(asyncio.create_task(self.discovery.run_forever(self.config.health_interval)))

    def abort_all(self, message: str) -> int:
        """End every request in flight (at shutdown): a stream with a `shutting_down` error event
        and `data: [DONE]`, a request still waiting for its worker with 503 `shutting_down`. Either
        way the worker's connection closes, which aborts the generation there. Returns how many."""
        self.ending = message
        streams, waiting = list(self.streams), list(self._forwarding)
        for relay in streams:
            relay.end(message)
        for task in waiting:
            task.cancel()
        return len(streams) + len(waiting)

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.kv is not None:
            await self.kv.subscriber.close()
        if self.client is not None:
            await self.client.aclose()

    # --- forwarding ------------------------------------------------------------------------

    async def forward(self, request: Request, path: str) -> Response:
        """Proxy one call (a completion, chat, any other /v1 POST, or a session's GET / DELETE) to a worker."""
        try:
            body = await read_body(request)
        except BodyTooLarge:
            return OpenAIErrorResponse("the request body is larger than the router's limit", 413,
                                       "invalid_request_error", "request_too_large")
        rejection = self.limits.admit(bearer_token(request))
        if rejection is not None:
            self.metrics.rejected.labels(rejection.level).inc()
            return OpenAIErrorResponse(rejection.message, 429, "rate_limit_error", "rate_limit_exceeded",
                                       headers={"Retry-After": rejection.retry_after_header})
        answer: Any = None
        try:
            # a client that left cancels the forwarding: the connection to the worker closes, which
            # aborts the generation there
            answer = await unless_disconnected(request, self._tracked(self._dispatch(request, path, body)))
            if answer is GONE:
                return Response(status_code=499) if self.ending is None else \
                    OpenAIErrorResponse(self.ending, 503, "server_error", "shutting_down")
            return answer
        finally:
            if isinstance(answer, RelayResponse):
                answer.on_close(self.limits.release)  # the slot is held until the stream ends
            else:
                self.limits.release()

    async def _tracked(self, work: Coroutine[Any, Any, Response]) -> Response:
        """`work`, cancelled by `abort_all` if it is still waiting for a worker then."""
        task = asyncio.current_task()
        assert task is not None
        self._forwarding.add(task)
        try:
            return await work
        finally:
            self._forwarding.discard(task)

    async def _dispatch(self, request: Request, path: str, body: bytes) -> Response:
        parsed = parse_json(body)
        route = route_request(request.headers, parsed)
        headers = forward_headers(request.headers)
        if request.method == "GET" and path.split("?", 1)[0] in LISTS:
            return await self._merged_list(path, headers)
        thing = named_thing(request.method, path, parsed)
        if thing is not None:  # a stored response, file or batch job: where it lives (homes.py)
            return await self._at_home(thing, request.method, path, body, headers)
        session = session_in_path(path)
        if session is None and request.method == "POST" and path.rstrip("/") == SESSIONS_PATH \
                and SESSION_HEADER not in headers:
            session = headers[SESSION_HEADER] = new_session_id()
        if session is not None:
            route = dataclasses.replace(route, session_key=session)
        self.forecaster.observe(requested_tokens(route.prompt_text, parsed))
        if self.kv is not None and self.policy.name == "cache_aware":
            route = await self.kv.tokenized(route, parsed)
        prefilled = None
        if self.prefill is not None and request.method == "POST":
            prefilled = await self.prefill.run(self.client, path.split("?", 1)[0], parsed, headers)
        tried: set[str] = set()
        failure: _Failure | None = None
        for attempt in range(MAX_ATTEMPTS):
            candidates = self.registry.available(exclude=tried)
            if not candidates:
                break
            decision = self._choose(route, candidates)
            tried.add(decision.worker.url)
            if attempt:
                self.metrics.retries.inc()
                logger.info("retrying on %s after: %s", decision.worker.url, failure.reason if failure else "")
            outcome = await self._attempt(decision.worker, request.method, path, body, headers)
            if not isinstance(outcome, _Failure):
                self._learn(request.method, path, outcome, decision.worker.url)
                if prefilled is not None:
                    outcome.headers[PREFILL_HEADER] = prefilled
                return outcome
            failure = outcome
        if failure is None:
            return self.no_worker_available()
        if failure.answer is not None:
            return failure.answer
        return OpenAIErrorResponse(f"no worker could answer: {failure.reason}", 502, "server_error", "worker_failed")

    async def _at_home(self, thing: str, method: str, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """To the replica that keeps `thing`; one not known yet is looked for, replica by replica,
        past their 404s."""
        candidates = self.registry.available()
        home = self.homes.get(thing)
        candidates.sort(key=lambda w: w.url != home)
        answer: Response | None = None
        for worker in candidates:
            outcome = await self._attempt(worker, method, path, body, headers)
            if isinstance(outcome, _Failure):
                answer = outcome.answer or answer
                continue
            answer = outcome
            if outcome.status_code != 404:
                self.homes.remember(thing, worker.url)
                self._learn(method, path, outcome, worker.url)
                return outcome
        return answer if answer is not None else self.no_worker_available()

    def _learn(self, method: str, path: str, answer: Response, url: str) -> None:
        """A creating POST's answer names a new thing that lives on the replica that answered."""
        if not isinstance(answer, RelayResponse):
            thing = created_id(method, path, answer.status_code, answer.body)
            if thing is not None:
                self.homes.remember(thing, url)

    async def _merged_list(self, path: str, headers: dict[str, str]) -> Response:
        answers = [await self._attempt(worker, "GET", path, b"", headers) for worker in self.registry.available()]
        bodies = [a.body for a in answers if not isinstance(a, _Failure) and a.status_code == 200]
        if not bodies:
            return self.no_worker_available()
        return Response(merged_list(bodies), 200, media_type="application/json")

    def _choose(self, route: RouteRequest, candidates: list[Worker]) -> Decision:
        decision = self.policy.choose(route, candidates)
        self.policy.routed(route, decision.worker)
        self.metrics.decisions.labels(decision.reason).inc()
        if decision.reason == "kv_prefix":
            self.metrics.kv_prefix_match.observe(decision.matched_tokens)
        elif self.policy.name == "cache_aware" and decision.reason != "session":
            self.metrics.prefix_match.observe(decision.matched_chars)
        return decision

    async def _attempt(self, worker: Worker, method: str, path: str, body: bytes,
                       headers: dict[str, str]) -> Response | _Failure:
        """Send the request to `worker`: its answer, or a `_Failure` if nothing reached the client
        and another worker may try. A stream is handed to a RelayResponse, which then owns the
        worker's response and in-flight count."""
        assert self.client is not None
        worker.requests += 1
        is_trial = worker.breaker.on_dispatch()
        self.metrics.requests.labels(worker.url).inc()
        lease, upstream, handed_over = _Lease(worker), None, False
        try:
            outgoing = self.client.build_request(method, worker.url + path, content=body, headers=headers)
            upstream = await self.client.send(outgoing, stream=True)
            if upstream.status_code in RETRYABLE_STATUS:
                content = await read_raw(upstream)
                self._failed(worker, "status", f"{worker.url} answered {upstream.status_code}")
                return _Failure(f"{worker.url} answered {upstream.status_code}",
                                Response(content, upstream.status_code, answer_headers(upstream, worker.url)))
            if upstream.status_code == 429:  # the engine-level limit: full there, not unwell
                self.metrics.rejected.labels("engine").inc()
                content = await read_raw(upstream)  # another replica may have room; else this is the answer
                return _Failure(f"{worker.url} is full (429)",
                                Response(content, 429, answer_headers(upstream, worker.url)))
            if is_event_stream(upstream):
                chunks = upstream.aiter_raw()
                first = await anext(chunks, b"")  # fail here and another worker can still take it
                self.registry.record_success(worker)
                relay = RelayResponse(first, chunks, status_code=upstream.status_code,
                                      headers=answer_headers(upstream, worker.url),
                                      on_broken=lambda e: self._failed(worker, "stream", repr(e)))
                relay.on_close(upstream.aclose)
                relay.on_close(lease.release)
                self.streams.add(relay)
                relay.on_close(lambda: self.streams.discard(relay))
                handed_over = True
                return relay
            content = await read_raw(upstream)
            self.registry.record_success(worker)
            return Response(content, upstream.status_code, answer_headers(upstream, worker.url))
        except httpx.HTTPError as e:
            kind = "connect" if isinstance(e, httpx.ConnectError) else \
                "timeout" if isinstance(e, httpx.TimeoutException) else "transport"
            self._failed(worker, kind, f"{worker.url}: {type(e).__name__} {e}".strip(),
                         refused=isinstance(e, httpx.ConnectError))
            return _Failure(f"{worker.url}: {type(e).__name__}")
        finally:
            if not handed_over:
                if is_trial and worker.breaker.state is BreakerState.HALF_OPEN:
                    worker.breaker.abandon_trial()  # no verdict (the client left): another request may try
                lease.release()
                if upstream is not None:
                    await upstream.aclose()

    def _failed(self, worker: Worker, kind: str, detail: str, *, refused: bool = False) -> None:
        logger.warning("worker %s failed (%s): %s", worker.url, kind, detail)
        self.metrics.errors.labels(worker.url, kind).inc()
        self.registry.record_failure(worker, detail, refused=refused)

    # --- the other routes ------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """The union of the available workers' models (by id, first answer wins)."""
        assert self.client is not None
        seen, statuses = await workers_models(self.client, [w.url for w in self.registry.available()],
                                              forward_headers(request.headers), MODELS_TIMEOUT)
        if not seen and statuses and all(s == 401 for s in statuses):
            return OpenAIErrorResponse("invalid or missing API key", 401, "authentication_error", "invalid_api_key")
        if not seen and not statuses:
            return self.no_worker_available()
        return JSONResponse({"object": "list", "data": seen})

    def health(self) -> Response:
        available = len(self.registry.available())
        if available:
            return JSONResponse({"status": "ok", "available_workers": available})
        return self.no_worker_available()

    def no_worker_available(self) -> Response:
        """503, naming each worker and why it takes no requests (or that there are none)."""
        return OpenAIErrorResponse(f"no worker is available: {self.registry.why_none_available()}", 503,
                                   "server_error", "no_available_worker")

    def describe(self) -> dict:
        described = {"policy": self.policy.name, "in_flight": self.limits.in_flight,
                     "workers": [w.describe() for w in self.registry.workers.values()]}
        return described if self.prefill is None else {**described, **self.prefill.describe()}


__all__ = ["RouterConfig", "Router", "WORKER_HEADER"]
