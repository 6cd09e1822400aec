"""The router's policies on a multi-turn chat workload, and the router's own cost, in one run.

    python benchmarks/router.py                      # writes results/router-<date>.json
    python benchmarks/router.py --sessions 8 --turns 3   # a quick look

For each policy (round_robin, consistent_hash, cache_aware) a fresh
`pagoda serve --data-parallel-size 2 --router-policy P` (two replicas of the model, each pinned
to its share of the cores, cold prefix caches) serves the same workload: `--sessions` chats that
share one system prompt, all at once, each sending `--turns` user turns one after another
(streamed, the model's answers appended to the history). No X-Session-ID is sent, so the
policies see what a plain OpenAI client sends. Measured per policy:

- prefix-cache hit rate: prompt tokens found in the cache / prompt tokens looked up, summed
  over the replicas' /metrics (pagoda:prefix_cache_hits / pagoda:prefix_cache_queries);
- TTFT: from sending a turn to its first streamed chunk, p50 / p90 / mean, and the run's wall time.

Then, on the last cluster, the router's overhead against talking to a replica directly, in
alternating rounds: a one-token non-streaming request (per-request overhead, median of the
differences), and a streamed `--overhead-tokens`-token answer (per-token overhead: the
difference in total time / tokens, and the mean gap between chunks either way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import httpx

from pagoda.bench.servers import free_port
from pagoda.platform import benchmark_cpu_flags, cpu_model

HERE = Path(__file__).parent
MODEL = "smollm2-135m-instruct"
ADMIN_KEY = "bench-admin"
POLICIES = ["round_robin", "consistent_hash", "cache_aware"]
SYSTEM = ("You are Pagoda Assistant, the support agent of an online shop that sells outdoor gear: tents, "
          "sleeping bags, stoves, backpacks and clothing. Answer briefly and politely. Shipping is free "
          "above 50 euros and takes two to four working days; returns are accepted within 30 days if the "
          "item is unused and in its original packaging; refunds reach the customer within a week of the "
          "return arriving. Never promise discounts. If a question is not about the shop, say so and "
          "offer help with an order instead. Sign every answer with '-- Pagoda Assistant'.")
TOPICS = ["a tent for two people", "a winter sleeping bag", "a camping stove", "a 40 litre backpack",
          "rain trousers", "a headlamp", "trekking poles", "a water filter", "hiking boots", "a down jacket",
          "a foam mattress", "a cooking pot set", "gaiters", "a map case", "a first-aid kit", "a bivy bag"]
FOLLOW_UPS = ["How long does shipping take?", "Can I return it if it does not fit?", "Is it waterproof?",
              "What if it arrives damaged?", "Do you ship abroad?", "Thanks, how do I pay?"]








class Cluster:
    """`pagoda serve --data-parallel-size 2 --router-policy P` as a subprocess."""

    def __init__(self, policy: str, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(HERE / "results" / f".router-bench-{policy}.log", "w")
        cmd = [sys.executable, "-m", "pagoda.cli", "serve", "--model", args.model, "--port",
               str(self.port), "--log-level", "warning", "--data-parallel-size", "2", "--router-policy", policy,
               "--router-admin-key", ADMIN_KEY, "--kv-cache-memory", str(args.kv_cache_memory)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the cluster exited; see {self.log.name}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the cluster did not come up")
        answer = httpx.get(f"{self.base}/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        self.replicas = [w["url"] for w in answer.json()["workers"]]

    def cache_counters(self) -> tuple[float, float]:
        """(hits, queries) in prompt tokens, summed over the replicas."""
        hits = queries = 0.0
        for url in self.replicas:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            hits += _metric(text, "pagoda:prefix_cache_hits")
            queries += _metric(text, "pagoda:prefix_cache_queries")
        return hits, queries

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"{re.escape(name)}(_total)?[{{ ]", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _stream_chat(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int,
                       ignore_eos: bool = False) -> tuple[float, float, str, int, list[float]]:
    """(ttft, total seconds, text, chunks, chunk arrival times) of one streamed chat answer."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": ignore_eos}
    start = time.perf_counter()
    ttft, parts, arrivals = None, [], []
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{answer.status_code}: {(await answer.aread())[:300]!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter() - start
            ttft = now if ttft is None else ttft
            arrivals.append(now)
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                parts.append(delta[0]["delta"]["content"])
    return ttft or 0.0, time.perf_counter() - start, "".join(parts), len(arrivals), arrivals


async def _session(client, base, i: int, turns: int, max_tokens: int, ttfts: list[float]) -> None:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Hello! I am looking for {TOPICS[i % len(TOPICS)]} (order {1000 + i})."}]
    for turn in range(turns):
        ttft, _, text, _, _ = await _stream_chat(client, base, messages, max_tokens)
        ttfts.append(ttft)
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": FOLLOW_UPS[(i + turn) % len(FOLLOW_UPS)]})


def run_policy(policy: str, args: argparse.Namespace) -> tuple[dict, Cluster]:
    cluster = Cluster(policy, args)
    hits0, queries0 = cluster.cache_counters()
    ttfts: list[float] = []

    async def workload():
        limits = httpx.Limits(max_connections=args.sessions + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            await asyncio.gather(*(_session(client, cluster.base, i, args.turns, args.max_tokens, ttfts)
                                   for i in range(args.sessions)))

    start = time.perf_counter()
    asyncio.run(workload())
    wall = time.perf_counter() - start
    hits1, queries1 = cluster.cache_counters()
    hits, queries = hits1 - hits0, queries1 - queries0
    ttfts.sort()
    result = {"policy": policy, "requests": len(ttfts), "wall_s": round(wall, 2),
              "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
              "prompt_tokens_looked_up": int(queries), "prompt_tokens_hit": int(hits),
              "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
              "ttft_p90_ms": round(1000 * ttfts[int(0.9 * len(ttfts))], 1),
              "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 1)}
    print(json.dumps(result), flush=True)
    return result, cluster


def overhead(cluster: Cluster, args: argparse.Namespace) -> dict:
    """Router vs direct, alternating, on the cluster's first replica (the router may pick either)."""
    direct, routed = cluster.replicas[0], cluster.base
    one = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1}

    async def measure():
        async with httpx.AsyncClient(timeout=300) as client:
            async def plain(base):
                start = time.perf_counter()
                answer = await client.post(f"{base}/v1/chat/completions", json=one)
                assert answer.status_code == 200, answer.text
                return time.perf_counter() - start

            for base in (direct, routed):  # warm the connections
                await plain(base)
            pairs = []
            for _ in range(args.overhead_rounds):
                pairs.append((await plain(direct), await plain(routed)))
            streams = {"direct": [], "router": []}
            messages = [{"role": "user", "content": "Tell me a long story about a mountain."}]
            for _ in range(args.overhead_stream_rounds):
                for name, base in (("direct", direct), ("router", routed)):
                    _, total, _, chunks, arrivals = await _stream_chat(client, base, messages, args.overhead_tokens,
                                                                       ignore_eos=True)
                    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
                    streams[name].append((total, chunks, statistics.fmean(gaps)))
            return pairs, streams

    pairs, streams = asyncio.run(measure())
    diffs = sorted(r - d for d, r in pairs)
    d_total = statistics.median(t for t, _, _ in streams["direct"])
    r_total = statistics.median(t for t, _, _ in streams["router"])
    chunks = statistics.median(c for _, c, _ in streams["direct"])
    result = {
        "request_direct_ms_p50": round(1000 * statistics.median(d for d, _ in pairs), 2),
        "request_router_ms_p50": round(1000 * statistics.median(r for _, r in pairs), 2),
        "request_overhead_ms_p50": round(1000 * diffs[len(diffs) // 2], 2),
        "stream_tokens": args.overhead_tokens, "stream_chunks": chunks,
        "stream_direct_s_p50": round(d_total, 3), "stream_router_s_p50": round(r_total, 3),
        "stream_overhead_ms_per_token": round(1000 * (r_total - d_total) / args.overhead_tokens, 3),
        "chunk_gap_direct_ms_mean": round(1000 * statistics.fmean(g for _, _, g in streams["direct"]), 2),
        "chunk_gap_router_ms_mean": round(1000 * statistics.fmean(g for _, _, g in streams["router"]), 2),
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16, help="per assistant turn")
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="per replica")
    p.add_argument("--overhead-rounds", type=int, default=30)
    p.add_argument("--overhead-stream-rounds", type=int, default=4)
    p.add_argument("--overhead-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from pagoda import __version__

    env = {"date": date.today().isoformat(), "command": " ".join(sys.argv), "pagoda": __version__,
           "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(), "cores": len(os.sched_getaffinity(0)),
           "torch": torch.__version__, "python": platform.python_version()}
    print(f"{env['cpu']}, {env['cores']} cores; flags: {' '.join(env['cpu_flags'])}", flush=True)
    started = time.perf_counter()
    policies, cluster = [], None
    for policy in POLICIES:
        if cluster is not None:
            cluster.stop()
        result, cluster = run_policy(policy, args)
        policies.append(result)
    try:
        cost = overhead(cluster, args)
    finally:
        cluster.stop()
    record = {"environment": env, "workload": {"model": args.model, "sessions": args.sessions, "turns": args.turns,
                                               "max_tokens": args.max_tokens, "replicas": 2,
                                               "shared_system_prompt": True, "session_header": False},
              "policies": policies, "router_overhead": cost, "seconds": round(time.perf_counter() - started, 1)}
    out = Path(args.out or HERE / "results" / f"router-{env['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
