"""Serving benchmark: N concurrent streaming clients against an OpenAI-compatible server.

    python benchmarks/serve_bench.py                      # starts pagoda serve and the naive
                                                          # transformers server itself, one run
    python benchmarks/serve_bench.py --base-url URL ...   # or measure any running server

Every request streams a completion for a random token-id prompt (fixed seed, --input-len
tokens) with --output-len tokens (ignore_eos where the server supports it). Reports aggregate
generated tokens/s, time to first token (TTFT) and inter-token latency (ITL) at p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> dict:
    body = {"prompt": prompt, "max_tokens": output_len, "stream": True, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and (chunk["choices"][0].get("text") or chunk["choices"][0].get("finish_reason")):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - start, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": output_len, "latency": stamps[-1] - start}


async def run_load(base_url: str, concurrency: int, num_requests: int, input_len: int, output_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(input_len)] for _ in range(num_requests)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600)) as client:
        async def guarded(p):
            async with sem:
                return await one_request(client, p, output_len)
        probe_latencies: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            """How quickly the server answers a trivial route while it is loaded."""
            while not done.is_set():
                t0 = time.perf_counter()
                await client.get("/health")
                probe_latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.1)

        start = time.perf_counter()
        prober = asyncio.create_task(probe())
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        elapsed = time.perf_counter() - start
        done.set()
        await prober
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": num_requests, "seconds": elapsed, "output_tokens_per_s": tokens / elapsed,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_ms": pct(itl, 50) * 1e3,
            "itl_p99_ms": pct(itl, 99) * 1e3, "e2e_p50_s": pct([r["latency"] for r in results], 50),
            "health_p50_ms": pct(probe_latencies, 50) * 1e3, "health_p99_ms": pct(probe_latencies, 99) * 1e3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=HERE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="measure this server instead of starting pagoda + transformers")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", default="64,16", help="pagoda concurrencies (comma-separated)")
    ap.add_argument("--hf-concurrency", type=int, default=8, help="clients (and requests) for the naive baseline")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-modes", default="thread", help="pagoda engine placements to compare: thread,process")
    ap.add_argument("--skip-hf", action="store_true", help="do not run the naive transformers baseline")
    ap.add_argument("--save", default=None)
    args = ap.parse_args()

    rows = []
    if args.base_url:
        for c in [int(x) for x in args.concurrency.split(",")]:
            rows.append({"system": args.base_url, **asyncio.run(run_load(args.base_url, c, c, args.input_len, args.output_len, args.seed))})
    else:
        for mode in args.engine_modes.split(","):
            port = free_port()
            extra = ["--engine-process"] if mode == "process" else []
            proc = start_server([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--model", args.model,
                                 "--port", str(port), "--log-level", "warning", *extra], port)
            try:
                for c in [int(x) for x in args.concurrency.split(",")]:
                    result = asyncio.run(run_load(f"http://127.0.0.1:{port}", c, c, args.input_len, args.output_len, args.seed))
                    rows.append({"system": f"pagoda serve ({mode})", **result})
                    print(rows[-1], file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    if not args.base_url and not args.skip_hf:
        port = free_port()
        proc = start_server([sys.executable, str(HERE / "hf_naive_server.py"), "--model", args.model, "--port", str(port)], port)
        try:
            c = args.hf_concurrency
            rows.append({"system": "transformers, one at a time", **asyncio.run(run_load(f"http://127.0.0.1:{port}", c, c, args.input_len, args.output_len, args.seed))})
            print(rows[-1], file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    print(f"\n{'system':<30} {'conc':>4} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'health p99':>10}")
    for r in rows:
        print(f"{r['system']:<30} {r['concurrency']:>4} {r['output_tokens_per_s']:>7.1f} {r['ttft_p50_s']:>8.2f}s "
              f"{r['ttft_p99_s']:>8.2f}s {r['itl_p50_ms']:>6.0f}ms {r['itl_p99_ms']:>6.0f}ms {r['health_p99_ms']:>8.0f}ms")
    save = Path(args.save) if args.save else HERE / "results" / f"serve-{date.today().isoformat()}.json"
    save.write_text(json.dumps({"date": date.today().isoformat(), "command": " ".join(sys.argv), "args": vars(args),
                                "results": rows}, indent=2))
    print(f"saved {save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
