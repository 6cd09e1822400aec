"""Routing with a shared KV tier (issue 43 item 3): once replicas share their KV blocks, a request
sent away from the replica that holds its prefix still hits (in the shared tier), so the router may
weigh load more and affinity less. Measured: `cache_aware` (affinity first) against `least_load`,
with and without a shared `--kv-offload-dir`, on a skewed document-QA workload.

    python benchmarks/router_shared_tier.py [--model smollm2-135m-instruct] [--requests 32]

Two replicas, each pinned to one core (``--cores 0 1``, ``--num-threads 1``), behind ``pagoda
router``; "shared" gives both the same directory in /dev/shm. The workload: ``--documents``
documents of ``--document-words`` random words, each request one of them plus a question of its
own (16 tokens out, streamed), the documents' popularity skewed (each asked 1/``--skew`` as often as
the one before), sent by ``--clients`` clients back to back. TTFT is the first SSE chunk's
time; the makespan is the whole run's. Writes results/router-shared-tier-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import httpx

from pd_itl import HERE, _router, _serve, _wait

WORDS = ["river", "stone", "light", "market", "engine", "garden", "paper", "window", "signal", "forest",
         "copper", "harbor", "winter", "ladder", "orchard", "velvet"]


def workload(a: argparse.Namespace) -> list[str]:
    rng = random.Random(0)
    documents = [" ".join(rng.choice(WORDS) for _ in range(a.document_words)) for _ in range(a.documents)]
    weights = [a.skew ** -i for i in range(a.documents)]  # each document asked 1/skew as often as the one before
    picks = rng.choices(range(a.documents), weights=weights, k=a.requests)
    return [f"{documents[d]}\n\nQuestion {i}: what does word {i % 50} of the text mean?" for i, d in enumerate(picks)]


def _ask(base: str, prompt: str) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, first = time.perf_counter(), None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as answer:
        worker = answer.headers.get("x-pagoda-worker")
        for line in answer.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter()
    return {"ttft_s": (first or time.perf_counter()) - start, "latency_s": time.perf_counter() - start,
            "worker": worker}


def run_clients(base: str, prompts: list[str], clients: int) -> tuple[list[dict], float]:
    todo: queue.Queue = queue.Queue()
    for p in prompts:
        todo.put(p)
    results: list[dict] = []

    def client() -> None:
        while True:
            try:
                prompt = todo.get_nowait()
            except queue.Empty:
                return
            results.append(_ask(base, prompt))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def run_setting(policy: str, shared: bool, prompts: list[str], a: argparse.Namespace) -> dict:
    kv_dir = tempfile.mkdtemp(prefix="pagoda-shared-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    tier = ["--kv-offload-dir", kv_dir] if shared else []
    started = [_serve(a.model, core, *tier) for core in a.cores]
    try:
        for proc, base in started:
            _wait(base, proc)
        router, base = _router(",".join(a.cores), "--policy", policy, *[x for _, u in started for x in ("--worker", u)])
        started.append((router, base))
        _wait(base, router)
        for _, replica in started[:-1]:  # warm each replica up (kernels, first allocations), off the record
            httpx.post(f"{replica}/v1/completions", json={"model": "m", "prompt": "warm up", "max_tokens": 4},
                       timeout=120)
        results, makespan = run_clients(base, prompts, a.clients)
    finally:
        for proc, _ in started:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(kv_dir, ignore_errors=True)
    ttfts = sorted(r["ttft_s"] for r in results)
    pct = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]  # noqa: E731
    per_worker: dict[str, int] = {}
    for r in results:
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + 1
    return {"policy": policy, "shared_tier": shared, "makespan_s": makespan, "ttft_p50_s": pct(0.5),
            "ttft_p90_s": pct(0.9), "ttft_p99_s": pct(0.99), "requests_per_replica": sorted(per_worker.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--cores", nargs=2, default=["0", "1"])
    p.add_argument("--documents", type=int, default=4)
    p.add_argument("--document-words", type=int, default=900)
    p.add_argument("--skew", type=float, default=2.0, help="each document is asked 1/skew as often as the one before")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--clients", type=int, default=4)
    a = p.parse_args()
    prompts = workload(a)
    rows = []
    for shared in (False, True):
        for policy in ("cache_aware", "least_load"):
            row = run_setting(policy, shared, prompts, a)
            rows.append(row)
            print(f"{policy:>11}, shared tier {'on ' if shared else 'off'}: makespan {row['makespan_s']:.1f} s, "
                  f"TTFT p50 {row['ttft_p50_s']:.2f} s p90 {row['ttft_p90_s']:.2f} s p99 {row['ttft_p99_s']:.2f} s, "
                  f"requests per replica {row['requests_per_replica']}", flush=True)
    out = HERE / "results" / f"router-shared-tier-{date.today()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": a.model, "args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
