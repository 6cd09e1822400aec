"""Prefill / decode disaggregation (issue 43 item 4): inter-token latency of running streams while
long prompts arrive, co-located against disaggregated, on the same cores split both ways.

    python benchmarks/pd_itl.py [--model smollm2-135m-instruct] [--streams 4] [--long-prompts 4]

Two cores (``--cores 0 1``), each replica pinned to one (taskset, ``--num-threads 1``), behind
``pagoda router`` on 127.0.0.1:

- co-located: two ``--kv-role both`` replicas, ``--policy round_robin``: each computes its share of
  the long prompts between its streams' decode steps;
- disaggregated: a ``--kv-role prefill`` replica on the first core and a ``--kv-role decode`` one on
  the second, ``--pd-disaggregation``, the KV handed over through a directory in /dev/shm.

The workload is the same for both: ``--streams`` chat streams of a short prompt generating
``--stream-tokens`` tokens start together; one second later ``--long-prompts`` requests of
``--long-tokens`` random-word tokens arrive ``--gap`` seconds apart (8 tokens out each). The ITL of
a stream is the time between its SSE chunks (the first excluded); the figures are over every stream's
gaps. Writes results/pd-itl-<date>.json and benchmarks/pd_itl.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import httpx

HERE = Path(__file__).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{base} exited")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{base} did not come up")


def _serve(model: str, core: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _port()
    cmd = ["taskset", "-c", core, sys.executable, "-m", "pagoda.cli", "serve", model, "--port", str(port),
           "--num-threads", "1", "--max-model-len", "4096", "--served-model-name", "m", "--log-level", "warning",
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _router(core: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = _port()
    cmd = ["taskset", "-c", core, sys.executable, "-m", "pagoda.cli", "router", "--port", str(port),
           "--log-level", "warning", "--health-interval", "1", *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def _stream(base: str, prompt: str, max_tokens: int, t0: float, out: list) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter() - t0)
    out.append(times)


def _long(base: str, prompt: str, t0: float, out: list) -> None:
    start = time.perf_counter()
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    out.append({"sent_s": start - t0, "latency_s": time.perf_counter() - start, "status": answer.status_code})


def run_workload(base: str, a: argparse.Namespace) -> dict:
    rng = random.Random(0)
    words = ["river", "stone", "light", "market", "engine", "garden", "paper", "window", "signal", "forest"]
    longs = [" ".join(rng.choice(words) for _ in range(a.long_tokens)) for _ in range(a.long_prompts)]
    streams, long_out = [], []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_stream, args=(base, f"Tell story number {i}.", a.stream_tokens, t0, streams))
               for i in range(a.streams)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the streams are decoding when the first long prompt arrives (a load shape, not a wait)
    for i, text in enumerate(longs):
        t = threading.Thread(target=_long, args=(base, text, t0, long_out))
        t.start()
        threads.append(t)
        time.sleep(a.gap)
    for t in threads:
        t.join()
    gaps = sorted(b - a_ for times in streams for a_, b in zip(times[1:], times[2:]))
    pct = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1000 if gaps else float("nan")
    return {"itl_p50_ms": pct(0.5), "itl_p90_ms": pct(0.9), "itl_p99_ms": pct(0.99), "itl_max_ms": pct(1.0),
            "gaps": len(gaps), "long_prompts": sorted(long_out, key=lambda r: r["sent_s"]),
            "streams": streams}


def run_mode(mode: str, a: argparse.Namespace) -> dict:
    kv_dir = tempfile.mkdtemp(prefix="pagoda-pd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    c0, c1 = a.cores
    if mode == "co-located":
        started = [_serve(a.model, c0), _serve(a.model, c1)]
        router_args = ["--policy", "round_robin", *[x for _, u in started for x in ("--worker", u)]]
    else:
        started = [_serve(a.model, c0, "--kv-role", "prefill", "--kv-offload-dir", kv_dir),
                   _serve(a.model, c1, "--kv-role", "decode", "--kv-offload-dir", kv_dir)]
        router_args = ["--pd-disaggregation", "--prefill", started[0][1], "--decode", started[1][1]]
    try:
        for proc, base in started:
            _wait(base, proc)
        router, base = _router(f"{c0},{c1}", *router_args)
        started.append((router, base))
        _wait(base, router)
        httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "warm up", "max_tokens": 4}, timeout=120)
        return {"mode": mode, **run_workload(base, a)}
    finally:
        for proc, _ in started:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(kv_dir, ignore_errors=True)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib  # deferred: only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r, color in zip(results, ["tab:red", "tab:blue"]):
        xs, ys = [], []
        for times in r["streams"]:
            for a_, b in zip(times[1:], times[2:]):
                xs.append(b)
                ys.append((b - a_) * 1000)
        ax.scatter(xs, ys, s=4, color=color, alpha=0.6,
                   label=f"{r['mode']}: ITL p50 {r['itl_p50_ms']:.0f} ms, p99 {r['itl_p99_ms']:.0f} ms")
        for lp in r["long_prompts"]:
            ax.axvline(lp["sent_s"], color=color, alpha=0.25, linestyle="--")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the streams started (dashed: a long prompt arrives)")
    ax.set_ylabel("inter-token latency of the running streams (ms)")
    ax.set_title("Running streams while long prompts arrive: co-located vs prefill/decode disaggregated")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--cores", nargs=2, default=["0", "1"])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=1500, help="words of each long prompt (about a token each)")
    p.add_argument("--gap", type=float, default=2.0)
    a = p.parse_args()
    results = [run_mode(mode, a) for mode in ("co-located", "disaggregated")]
    for r in results:
        lat = [round(x["latency_s"], 2) for x in r["long_prompts"]]
        print(f"{r['mode']:>14}: ITL p50 {r['itl_p50_ms']:.1f} ms, p90 {r['itl_p90_ms']:.1f}, p99 "
              f"{r['itl_p99_ms']:.1f}, max {r['itl_max_ms']:.1f} ({r['gaps']} gaps); long prompts' latency {lat} s")
    out = HERE / "results" / f"pd-itl-{date.today()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    plot(results, HERE / "pd_itl.png")
    print(f"wrote {out} and {HERE / 'pd_itl.png'}")


if __name__ == "__main__":
    main()
