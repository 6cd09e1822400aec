"""A soak run: many mixed requests against a running server, then a check that nothing leaked.

The mix is what a busy server sees: completions and chat, streamed and not, streams the client
drops halfway, structured outputs, priorities, n > 1, prompts that share a cached prefix and
prompts that do not, and a few invalid bodies. Afterwards the server must be idle (no request
running or waiting, no KV block held by a request), its counters must agree with what was sent,
and its resident memory (its KV cache's pages aside, which grow into the cache's budget) must not
grow with the number of requests served.

    python -m pagoda.bench.soak --base-url http://127.0.0.1:8000 --requests 10000 --pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagoda.bench.servers import wait_idle

KINDS = ("completion", "chat_stream", "dropped_stream", "structured", "n2", "cached", "invalid")
_WEIGHTS = (3, 3, 2, 1, 1, 3, 1)
_SHARED_PREFIX = "You are a helpful assistant. Answer briefly."


@dataclass
class SoakReport:
    requests: int = 0
    seconds: float = 0.0
    by_kind: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    finished_engine_requests: int = 0  # prompts the engine finished normally (stop / length)
    dropped: int = 0  # streams the client closed early
    unexpected: list[str] = field(default_factory=list)
    rss_samples: list[tuple[int, int]] = field(default_factory=list)  # (requests done, total RSS bytes)
    kv_cache_samples: list[int] = field(default_factory=list)  # the KV caches' resident bytes at each RSS sample
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)

    def rss_slope_bytes_per_request(self, warmup: float = 0.2) -> float:
        """Least-squares slope of RSS against requests served, after the first `warmup` share,
        without the KV caches' pages (kv_cache_rss_bytes: they grow into the cache's budget as
        its blocks are first used, a bounded growth that is no leak)."""
        kv = self.kv_cache_samples or [0] * len(self.rss_samples)
        points = [(n, rss - cache) for (n, rss), cache in zip(self.rss_samples, kv) if n >= warmup * self.requests]
        if len(points) < 2:
            return 0.0
        n = len(points)
        mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        var = sum((x - mx) ** 2 for x, _ in points)
        return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0

    def delta(self, name: str) -> float:
        return self.metrics_after.get(name, 0.0) - self.metrics_before.get(name, 0.0)

    def summary(self) -> dict:
        rss = [y for _, y in self.rss_samples]
        return {
            "requests": self.requests, "seconds": round(self.seconds, 1),
            "requests_per_second": round(self.requests / self.seconds, 1) if self.seconds else None,
            "by_kind": dict(self.by_kind), "statuses": {str(k): v for k, v in self.statuses.items()},
            "dropped_streams": self.dropped,
            "aborted_by_server": self.delta("pagoda:request_success_total:abort") if self.metrics_after else None,
            "unexpected": self.unexpected[:20],
            "rss_mib_first_last": [round(rss[0] / 2**20, 1), round(rss[-1] / 2**20, 1)] if rss else None,
            "kv_cache_rss_mib_first_last": ([round(self.kv_cache_samples[0] / 2**20, 1),
                                             round(self.kv_cache_samples[-1] / 2**20, 1)]
                                            if self.kv_cache_samples else None),
            "rss_slope_bytes_per_request": round(self.rss_slope_bytes_per_request(), 1),
            "metrics_delta": {k: self.delta(k) for k in sorted(self.metrics_after)},
        }


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def kv_cache_rss_bytes(pids: list[int]) -> int:
    """The resident bytes of the processes' KV caches: the shared anonymous maps (`/dev/zero
    (deleted)` in smaps) that worker/kv_cache.py's `zeroed` makes. The kernel hands out each page
    on its first write, so a cache grows into its budget as its blocks are first used: the
    soak's 20 MiB cache over its first ~750 requests, as the block pool cycles through."""
    total = 0
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
        except OSError:
            continue
        in_cache = False
        for line in lines:
            if line[:1] in "0123456789abcdef":  # a mapping's header (its hex address); fields are capitalized
                in_cache = line.endswith("/dev/zero (deleted)")
            elif in_cache and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def _body(kind: str, rng: random.Random, model: str) -> tuple[str, dict]:
    words = " ".join(rng.choice(("red", "blue", "cat", "sky", "tree", "42", "river", "code")) for _ in range(rng.randint(3, 20)))
    common = {"model": model, "max_tokens": rng.randint(1, 24), "temperature": rng.choice((0.0, 0.7, 1.0)),
              "priority": rng.randint(-2, 2), "seed": rng.randint(0, 10**6)}
    if kind == "completion":
        return "/v1/completions", {**common, "prompt": words}
    if kind == "cached":
        return "/v1/completions", {**common, "prompt": _SHARED_PREFIX + words}
    if kind == "n2":
        return "/v1/completions", {**common, "prompt": words, "n": 2}
    if kind == "structured":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}],
                                        "guided_regex": "(yes|no) [0-9]{1,3}"}
    if kind in ("chat_stream", "dropped_stream"):
        # A dropped stream asks for the whole context and reads a few chunks: the abort ends it.
        max_tokens = None if kind == "dropped_stream" else common["max_tokens"]
        return "/v1/chat/completions", {**common, "max_tokens": max_tokens, "ignore_eos": kind == "dropped_stream",
                                        "messages": [{"role": "system", "content": _SHARED_PREFIX},
                                                     {"role": "user", "content": words}], "stream": True}
    return "/v1/completions", {**common, "prompt": words, "temperature": -1}  # invalid: 400


async def _one(client: httpx.AsyncClient, kind: str, path: str, body: dict, report: SoakReport) -> None:
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as r:
            report.statuses[r.status_code] += 1
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    report.unexpected.append(f"{kind}: {line[:200]}")
                chunks += line.startswith("data: ")
                if kind == "dropped_stream" and chunks >= 4:
                    report.dropped += 1
                    return  # leaving the block closes the connection mid-stream
        report.finished_engine_requests += 1
        return
    r = await client.post(path, json=body)
    report.statuses[r.status_code] += 1
    expected = 400 if kind == "invalid" else 200
    if r.status_code != expected:
        report.unexpected.append(f"{kind}: {r.status_code} {r.text[:200]}")
    elif expected == 200:
        report.finished_engine_requests += 1  # one prompt: one engine request, whatever n is


async def _run(base_url: str, requests: int, concurrency: int, seed: int, model: str, pids: list[int],
               report: SoakReport) -> None:
    rng = random.Random(seed)
    plan = rng.choices(KINDS, weights=_WEIGHTS, k=requests)
    queue: asyncio.Queue = asyncio.Queue()
    for i, kind in enumerate(plan):
        queue.put_nowait((i, kind, *_body(kind, rng, model)))
    sample_every = max(1, requests // 50)
    done = 0

    async def worker() -> None:
        nonlocal done
        # A connection per worker (dropped streams close theirs; the client opens a new one).
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            while not queue.empty():
                i, kind, path, body = queue.get_nowait()
                report.by_kind[kind] += 1
                try:
                    await _one(client, kind, path, body, report)
                except httpx.HTTPError as e:
                    report.unexpected.append(f"{kind}: {type(e).__name__}: {e}")
                done += 1
                if pids and done % sample_every == 0:
                    report.rss_samples.append((done, rss_bytes(pids)))
                    report.kv_cache_samples.append(kv_cache_rss_bytes(pids))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def soak(base_url: str, requests: int, *, concurrency: int = 16, seed: int = 0, model: str | None = None,
         pids: list[int] | None = None) -> SoakReport:
    """Run the mix, wait for the server to be idle, and return what was seen."""
    model = model or httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    report = SoakReport(requests=requests)
    report.metrics_before = wait_idle(base_url)
    start = time.monotonic()
    asyncio.run(_run(base_url, requests, concurrency, seed, model, pids or [], report))
    report.seconds = time.monotonic() - start
    report.metrics_after = wait_idle(base_url)
    return report


def check(report: SoakReport) -> list[str]:
    """What is wrong after a soak (empty when all is well): unexpected answers, and counters
    that disagree with what was sent.

    A dropped stream whose request the server had already finished (the client reads more
    slowly than a tiny model writes, so its last chunks were still buffered) is rightly counted
    as finished: the totals must match exactly, and aborts can only come from dropped streams."""
    problems = list(report.unexpected)
    reasons = {k.rsplit(":", 1)[1] for k in report.metrics_after if k.startswith("pagoda:request_success_total:")}
    # n > 1 samples that end differently count once, as e.g. "length,stop".
    finished = sum(report.delta(f"pagoda:request_success_total:{r}") for r in reasons if r not in ("abort", "error"))
    aborted = report.delta("pagoda:request_success_total:abort")
    sent = report.finished_engine_requests + report.dropped
    if finished + aborted != sent:
        problems.append(f"requests counted: {finished:g} finished + {aborted:g} aborted, client sent {sent}")
    if aborted > report.dropped:
        problems.append(f"{aborted:g} requests aborted, but the client dropped only {report.dropped}")
    if report.delta("pagoda:request_success_total:error"):
        problems.append(f"{report.delta('pagoda:request_success_total:error'):g} requests ended in error")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pid", type=int, action="append", default=[], help="processes whose RSS to sample (repeatable)")
    p.add_argument("--save-result", default=None, help="write the summary as JSON here")
    ns = p.parse_args(argv)
    report = soak(ns.base_url, ns.requests, concurrency=ns.concurrency, seed=ns.seed, pids=ns.pid)
    summary = {**report.summary(), "problems": check(report)}
    text = json.dumps(summary, indent=2)
    print(text)
    if ns.save_result:
        Path(ns.save_result).write_text(text + "\n")
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
