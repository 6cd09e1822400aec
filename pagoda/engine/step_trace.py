"""The engine's flight recorder: what the last steps and requests did, for /v1/debug and the dashboard.

`EngineCore` calls four hooks: `arrived` (a request is added), `begin_step` (the scheduler's
choice for this step), `end_step` (the model ran) and `finished` (however a request ends). They
keep a few integers per step and per request in bounded buffers:

- the last `max_steps` steps (`StepRecord`: rows and tokens of prefill and decode, step time,
  preemptions, running / waiting, KV usage);
- a timeline per request (`RequestTrace`: arrival, first scheduling, each prefill chunk, first
  token, preemptions, finish), live ones plus the last `max_requests` finished;
- one-second buckets over the last `max_seconds` (`SecondBucket`: steps, busy time, prompt and
  generated tokens, and log-scale histograms of TTFT and inter-token latency).

Decode rows cost one comparison and an increment per step; only prefill chunks (rare: a prompt
is chunked a few times) and request arrivals / finishes append records. The snapshots
(`engine`, `steps`, `requests`, `radix`) are built on demand, on the engine's own thread or
process between steps (core_client.py), so nothing here is shared with another thread.

Latencies are the engine's view: TTFT runs from a request's arrival (when the server tokenized
it) to the end of the step that sampled its first token; a decode row's inter-token latency is
the time since the previous step ended (a running request is in every step). Percentiles come
from histograms with bins 1.25x wide (about ±12 %).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.core.radix_cache import RadixCache, RadixNode
    from pagoda.core.scheduler_output import SchedulerOutput
    from pagoda.request import Request

# Histogram bins: bin k holds values in [_BASE * _RATIO**k, _BASE * _RATIO**(k+1)) seconds;
# 0.1 ms to ~2 minutes in 64 bins.
_BASE, _RATIO, _BINS = 1e-4, 1.25, 64
_LOG_RATIO = math.log(_RATIO)


def _bin(seconds: float) -> int:
    if seconds <= _BASE:
        return 0
    return min(_BINS - 1, int(math.log(seconds / _BASE) / _LOG_RATIO))


def percentiles(histogram: list[int], qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """{"p50": ms, ...} of a histogram (each bin's geometric middle); None when it is empty."""
    total = sum(histogram)
    out: dict[str, float | None] = {f"p{q * 100:g}": None for q in qs}
    if not total:
        return out
    keys, ranks = list(out), [q * total for q in qs]
    seen, i = 0, 0
    for k, count in enumerate(histogram):
        seen += count
        while i < len(ranks) and count and seen >= ranks[i]:
            out[keys[i]] = round(_BASE * _RATIO ** (k + 0.5) * 1000, 3)
            i += 1
        if i == len(ranks):
            break
    return out


@dataclass(slots=True)
class StepRecord:
    step: int
    start: float  # monotonic
    duration: float
    interval: float  # since the previous step ended
    prefill_rows: int
    prefill_tokens: int
    decode_rows: int
    decode_tokens: int  # with speculative decoding: the last token and the drafts verified
    generated_tokens: int
    preempted: int
    running: int
    waiting: int
    kv_usage: float

    def describe(self, to_unix: float) -> dict:
        return {"step": self.step, "time": round(self.start + to_unix, 4),
                "duration_ms": round(self.duration * 1000, 3), "interval_ms": round(self.interval * 1000, 3),
                "prefill_requests": self.prefill_rows, "prefill_tokens": self.prefill_tokens,
                "decode_requests": self.decode_rows, "decode_tokens": self.decode_tokens,
                "generated_tokens": self.generated_tokens, "preempted": self.preempted,
                "running": self.running, "waiting": self.waiting, "kv_usage": round(self.kv_usage, 4)}


@dataclass(slots=True)
class RequestTrace:
    request_id: str
    arrival: float
    prompt_tokens: int
    priority: int
    first_scheduled: float | None = None
    chunks: list[list] = field(default_factory=list)  # [step, start, duration, tokens]
    first_token: float | None = None
    preemptions: list[float] = field(default_factory=list)
    finish: float | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    cached_tokens: int = 0

    def describe(self, now: float, to_unix: float) -> dict:
        ms = lambda t: None if t is None else round((t - self.arrival) * 1000, 3)  # noqa: E731
        end = self.finish if self.finish is not None else now
        decode_ms = None if self.first_token is None else round((end - self.first_token) * 1000, 3)
        gaps = self.output_tokens - 1
        return {
            "request_id": self.request_id,
            "state": "finished" if self.finish is not None else "running" if self.first_scheduled else "waiting",
            "arrival": round(self.arrival + to_unix, 4), "priority": self.priority,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "queued_ms": ms(self.first_scheduled if self.first_scheduled is not None else end),
            "prefill_chunks": [{"step": s, "start_ms": ms(start), "duration_ms": round(d * 1000, 3), "tokens": n}
                               for s, start, d, n in self.chunks],
            "first_token_ms": ms(self.first_token),
            "decode_ms": decode_ms,
            "mean_itl_ms": round(decode_ms / gaps, 3) if decode_ms is not None and gaps > 0 else None,
            "preemptions_ms": [ms(t) for t in self.preemptions],
            "finish_reason": self.finish_reason,
            "total_ms": ms(end),
        }


@dataclass(slots=True)
class SecondBucket:
    second: int  # int(monotonic)
    steps: int = 0
    busy: float = 0.0
    prompt_tokens: int = 0  # prompt (and recomputed) tokens computed
    generated_tokens: int = 0
    finished: int = 0
    preemptions: int = 0
    running: int = 0  # the most in one step
    waiting: int = 0  # the most after one step
    kv_usage: float = 0.0  # the highest after one step
    ttft: list[int] = field(default_factory=lambda: [0] * _BINS)
    itl: list[int] = field(default_factory=lambda: [0] * _BINS)

    def describe(self, to_unix: float) -> dict:
        return {"time": round(self.second + to_unix, 3), "steps": self.steps, "busy": round(min(1.0, self.busy), 4),
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "finished": self.finished, "preemptions": self.preemptions, "running": self.running,
                "waiting": self.waiting, "kv_usage": round(self.kv_usage, 4),
                "ttft_ms": percentiles(self.ttft), "itl_ms": percentiles(self.itl)}


class StepTrace:
    def __init__(self, max_steps: int = 256, max_requests: int = 100, max_seconds: int = 120) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)
        self.live: dict[str, RequestTrace] = {}
        self.done: deque[RequestTrace] = deque(maxlen=max_requests)
        self.seconds: deque[SecondBucket] = deque(maxlen=max_seconds)
        self.num_steps = 0
        self._start = 0.0
        self._last_end = 0.0
        self._open_chunks: list[list] = []
        self._first_tokens: list[RequestTrace] = []
        self._rows = (0, 0, 0, 0)

    # -- hooks (engine thread / process) -----------------------------------------------------
    def arrived(self, request: Request) -> None:
        self.live[request.request_id] = RequestTrace(request.request_id, request.arrival_time,
                                                     request.num_prompt_tokens, request.priority)

    def begin_step(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Classify the step's rows: a decode row has one token left to compute and output
        already; anything else (a prompt chunk, a recompute after preemption) is a prefill."""
        self._start = now = time.monotonic()
        prefill_rows = prefill_tokens = decode_rows = decode_tokens = 0
        for rid, num_new in sched.num_scheduled_tokens.items():
            request = requests[rid]
            if request.num_tokens - request.num_computed_tokens == 1 and request.output_token_ids:
                decode_rows += 1
                decode_tokens += num_new
                continue
            prefill_rows += 1
            prefill_tokens += num_new
            trace = self.live.get(rid)
            if trace is None:
                continue
            if trace.first_scheduled is None:
                trace.first_scheduled = now
            chunk = [self.num_steps, now, 0.0, num_new]
            trace.chunks.append(chunk)
            self._open_chunks.append(chunk)
            if trace.first_token is None and request.num_computed_tokens + num_new >= request.num_tokens:
                self._first_tokens.append(trace)
        for rid in sched.preempted_req_ids:
            trace = self.live.get(rid)
            if trace is not None:
                trace.preemptions.append(now)
        self._rows = (prefill_rows, prefill_tokens, decode_rows, decode_tokens)

    def end_step(self, sched: SchedulerOutput, generated_tokens: int, running: int, waiting: int,
                 kv_usage: float) -> None:
        end = time.monotonic()
        duration = end - self._start
        interval = end - self._last_end if self._last_end else duration
        prefill_rows, prefill_tokens, decode_rows, decode_tokens = self._rows
        preempted = len(sched.preempted_req_ids)
        self.steps.append(StepRecord(self.num_steps, self._start, duration, interval, prefill_rows, prefill_tokens,
                                     decode_rows, decode_tokens, generated_tokens, preempted, running, waiting,
                                     kv_usage))
        self.num_steps += 1
        self._last_end = end
        bucket = self._bucket(end)
        bucket.steps += 1
        bucket.busy += duration
        bucket.prompt_tokens += prefill_tokens
        bucket.generated_tokens += generated_tokens
        bucket.preemptions += preempted
        bucket.running = max(bucket.running, prefill_rows + decode_rows)
        bucket.waiting = max(bucket.waiting, waiting)
        bucket.kv_usage = max(bucket.kv_usage, kv_usage)
        if decode_rows:
            bucket.itl[_bin(interval)] += decode_rows
        for chunk in self._open_chunks:
            chunk[2] = duration
        self._open_chunks.clear()
        for trace in self._first_tokens:
            trace.first_token = end
            bucket.ttft[_bin(end - trace.arrival)] += 1
        self._first_tokens.clear()

    def finished(self, request: Request, reason: str | None) -> None:
        trace = self.live.pop(request.request_id, None)
        if trace is None:
            return
        trace.finish = time.monotonic()
        trace.finish_reason = reason
        trace.output_tokens = request.num_output_tokens
        trace.cached_tokens = request.num_cached_tokens or 0
        self._bucket(trace.finish).finished += 1
        self.done.append(trace)

    def _bucket(self, now: float) -> SecondBucket:
        second = int(now)
        if not self.seconds or self.seconds[-1].second != second:
            self.seconds.append(SecondBucket(second))
        return self.seconds[-1]

    # -- snapshots (plain dicts: they cross to the server's process) -------------------------
    def window(self, seconds: int, now: float) -> dict:
        """Totals and percentiles over the last `seconds` whole seconds before `now`'s."""
        current = int(now)
        buckets = [b for b in self.seconds if current - seconds <= b.second < current]
        ttft, itl = [0] * _BINS, [0] * _BINS
        for b in buckets:
            ttft = [x + y for x, y in zip(ttft, b.ttft)]
            itl = [x + y for x, y in zip(itl, b.itl)]
        total = lambda name: sum(getattr(b, name) for b in buckets)  # noqa: E731
        return {"seconds": seconds, "steps": total("steps"),
                "busy": round(total("busy") / seconds, 4),
                "prompt_tokens_per_s": round(total("prompt_tokens") / seconds, 2),
                "generation_tokens_per_s": round(total("generated_tokens") / seconds, 2),
                "finished_requests": total("finished"), "preemptions": total("preemptions"),
                "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl)}

    def engine_snapshot(self, stats: dict, config: dict, window_seconds: int = 10, series_seconds: int = 60) -> dict:
        """Counters and gauges (`stats`), the last `window_seconds` summed up, and one point per
        second over the last `series_seconds` (seconds without a step are zeros)."""
        now, to_unix = _clock()
        current = int(now)
        kept = {b.second: b for b in self.seconds}
        series = [kept[s].describe(to_unix) if s in kept else _idle_second(s + to_unix)
                  for s in range(current - series_seconds, current)]
        return {"time": round(now + to_unix, 4), "num_steps": self.num_steps, "stats": stats, "config": config,
                "window": self.window(window_seconds, now), "series": series}

    def steps_snapshot(self, limit: int = 256) -> list[dict]:
        _, to_unix = _clock()
        return [s.describe(to_unix) for s in list(self.steps)[-limit:]][::-1]

    def requests_snapshot(self, limit: int = 100) -> list[dict]:
        """Live requests (waiting, running) first, newest first, then finished ones, newest first."""
        now, to_unix = _clock()
        live = sorted(self.live.values(), key=lambda t: t.arrival, reverse=True)
        finished = list(self.done)[::-1]
        return [t.describe(now, to_unix) for t in (live + finished)[:limit]]


_NO_LATENCY = {"p50": None, "p90": None, "p99": None}


def _idle_second(unix: float) -> dict:
    """A second without a step (what SecondBucket.describe gives for one, without building it)."""
    return {"time": round(unix, 3), "steps": 0, "busy": 0.0, "prompt_tokens": 0, "generated_tokens": 0,
            "finished": 0, "preemptions": 0, "running": 0, "waiting": 0, "kv_usage": 0.0,
            "ttft_ms": _NO_LATENCY, "itl_ms": _NO_LATENCY}


def _clock() -> tuple[float, float]:
    """(monotonic now, what turns a monotonic time into Unix time)."""
    mono, wall = time.monotonic(), time.time()
    return mono, wall - mono


def radix_snapshot(cache: RadixCache | None, limit: int = 20, preview_tokens: int = 48) -> dict:
    """The largest cached prefixes (the deepest leaves by tokens) and the tree of their paths.

    Each node: its own edge (tokens, blocks), `prefix_tokens` from the root to its end,
    `references` (requests and session pins holding it or a node below: its lock count), its
    age (seconds since a request last matched or inserted through it), its children, and the
    first `preview_tokens` token ids of its edge (the server turns them into text)."""
    if cache is None:
        return {"enabled": False, "nodes": [], "prefixes": []}
    now = time.monotonic()
    depth: dict[int, int] = {}
    leaves: list[RadixNode] = []
    num_nodes = 0
    stack = [(root, 0) for root in cache._roots.values()]  # noqa: SLF001 - a read-only walk
    while stack:
        node, above = stack.pop()
        num_nodes += 1
        depth[id(node)] = total = above + len(node.tokens)
        if node.children:
            stack.extend((child, total) for child in node.children.values())
        elif node.parent is not None:
            leaves.append(node)
    leaves.sort(key=lambda n: depth[id(n)], reverse=True)
    salts = {id(root): salt for salt, root in cache._roots.items()}  # noqa: SLF001
    ids: dict[int, int] = {}
    nodes: list[dict] = []

    def add(node: RadixNode) -> int:
        key = id(node)
        if key in ids:
            return ids[key]
        parent = None if node.parent is None else add(node.parent)
        ids[key] = len(nodes)
        entry = {"id": len(nodes), "parent": parent, "tokens": len(node.tokens), "blocks": len(node.blocks),
                 "prefix_tokens": depth[key], "references": node.lock_ref - (node.parent is None),
                 "age_s": round(now - node.last_access_time, 3) if node.last_access_time else None,
                 "children": len(node.children), "token_ids": list(node.tokens[:preview_tokens])}
        if node.parent is None:
            entry["salt"] = salts.get(key)
        nodes.append(entry)
        return ids[key]

    prefixes = []
    for leaf in leaves[:limit]:
        node_id = add(leaf)
        prefixes.append({"node": node_id, "prefix_tokens": depth[id(leaf)], "references": leaf.lock_ref,
                         "age_s": nodes[node_id]["age_s"]})
    return {"enabled": True, "block_size": cache.block_size, "cached_blocks": cache.num_cached_blocks,
            "evictable_blocks": cache.num_evictable_blocks, "num_nodes": num_nodes - len(cache._roots),  # noqa: SLF001
            "num_leaves": len(leaves), "nodes": nodes, "prefixes": prefixes}
