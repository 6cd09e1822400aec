"""Does batch work hurt interactive latency? One `pagoda serve`, three phases, side by side:

1. idle: interactive chat requests one after another, time to first token (TTFT) of each;
2. the same requests while a Batch API job runs (its lines at batch priority);
3. the same while the same job runs with every line's `priority` raised back to 0 (as if it
   were interactive traffic: what the batch priority buys).

For 2 and 3 it also reports the batch's generated tokens per second while the interactive
requests ran (the server's generation counter, less the interactive requests' own tokens).

    python benchmarks/batch_priority.py --model smollm2-135m-instruct --out benchmarks/results/batch-priority.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

BATCH_PRIORITY = 1000  # batch_lines.BATCH_PRIORITY's size: a line's priority +1000 cancels it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "serve", "--model", model, "--port", str(port),
                             "--served-model-name", "m", "--state-dir", "none", "--log-level", "warning", *extra])
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def _ttft(base: str, question: str, max_tokens: int) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=300, json={
            "model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}) as response:
        first = None
        for line in response.iter_lines():  # read to the end: the request's tokens are all counted
            if first is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
    return first if first is not None else time.perf_counter() - started


def _interactive(base: str, count: int, max_tokens: int) -> list[float]:
    return [_ttft(base, f"Question {i}: what is {i} plus {i}? Explain.", max_tokens) for i in range(count)]


def _submit_batch(base: str, lines: int, max_tokens: int, priority: int) -> str:
    body = b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "priority": priority}}).encode() + b"\n"
        for i in range(lines))
    file = httpx.post(f"{base}/v1/files", files={"file": ("b.jsonl", body)}, data={"purpose": "batch"}, timeout=60)
    batch = httpx.post(f"{base}/v1/batches", timeout=60, json={
        "input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    return batch.json()["id"]


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _under_batch(base: str, args, priority: int) -> dict:
    batch_id = _submit_batch(base, args.batch_lines, args.batch_tokens, priority)
    while _metric(base, "pagoda:num_requests_running") < min(8, args.batch_lines):  # the batch is running
        time.sleep(0.1)
    start, tokens0 = time.perf_counter(), _metric(base, "pagoda:generation_tokens_total")
    ttfts = _interactive(base, args.requests, args.max_tokens)
    elapsed = time.perf_counter() - start
    batch_tokens = _metric(base, "pagoda:generation_tokens_total") - tokens0 - args.requests * args.max_tokens
    httpx.post(f"{base}/v1/batches/{batch_id}/cancel", timeout=30)
    while _metric(base, "pagoda:num_requests_running") > 0:  # the next phase starts idle
        time.sleep(0.1)
    return {"ttft": ttfts, "batch_tokens_per_s": batch_tokens / elapsed}


def _summary(ttfts: list[float]) -> dict:
    ordered = sorted(ttfts)
    return {"p50_s": statistics.median(ordered), "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
            "mean_s": statistics.fmean(ordered)}


def _cpu_flags() -> list[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return sorted(set(re.findall(r"\b(avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*)\b", text)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=12, help="interactive requests per phase")
    parser.add_argument("--max-tokens", type=int, default=16, help="each interactive request's answer")
    parser.add_argument("--batch-lines", type=int, default=400)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--server-arg", action="append", default=[], help="more `pagoda serve` flags")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    proc, base = _start(args.model, args.server_arg)
    try:
        _interactive(base, 2, args.max_tokens)  # warm-up
        idle = _interactive(base, args.requests, args.max_tokens)
        low = _under_batch(base, args, 0)
        same = _under_batch(base, args, BATCH_PRIORITY)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {"model": args.model, "cpu": platform.processor() or platform.machine(), "cpu_flags": _cpu_flags(),
              "command": " ".join(sys.argv), "idle": _summary(idle),
              "batch_priority": {**_summary(low["ttft"]), "batch_tokens_per_s": low["batch_tokens_per_s"]},
              "batch_at_interactive_priority": {**_summary(same["ttft"]),
                                                "batch_tokens_per_s": same["batch_tokens_per_s"]}}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
