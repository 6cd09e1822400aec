"""What `--auth-config` (and `--audit-log`) cost on the common path, side by side with no auth.

    python benchmarks/auth_overhead.py          # writes results/auth-overhead-<date>.json

Three `pagoda serve` of the tiny random Llama (tests/tiny_models.py: the model nearly free, so
the server's own cost is as large a share as it gets; an upper bound for a real model), up at
once and driven in turn, `--repeats` times each:

- `none`: no keys; `none-2`: the same, a second process: the control, whose difference from
  `none` is the noise floor between two server processes doing the same work;
- `auth`: `--auth-config` with 1,000 keys (10 tenants x 100, the key used in the middle of the
  file) under a role with every limit set high enough never to refuse (so every check runs:
  model globs, requests per second, requests at once, tokens per minute, max_tokens, priority,
  the tenant's cache salt);
- `auth+audit`: the same plus `--audit-log` (no content).

Each run: `--requests` short requests (`/v1/completions`, 1 token, 8 clients at once), then
`--streams` SSE streams of `--tokens` tokens each. Measured: requests/s and tokens/s, and the
server process's CPU per request and per token (engine thread included; its threads' schedstat
run times, in ns). The end-to-end numbers move with whatever else the machine runs, so the
checks a request adds are also timed alone, in this process (`micro`): key lookup and hash over
the 1,000-key file, the limit checks, the request context and its hooks. Medians of the repeats
go to the summary, with each setup's ratio to `none` (the median of the repeats' ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import asyncio
import json
import statistics
import sys
import tempfile
import time
import timeit
from datetime import date
from pathlib import Path

import httpx

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
PROMPT = "Write a short story about a lighthouse keeper."
ROLE = {"models": ["tiny*"], "requests_per_second": 100000, "max_concurrent": 10000,
        "tokens_per_minute": 10**12, "max_tokens": 4096, "priority": 1}


def write_config(path: Path, tenants: int = 10, per_tenant: int = 100) -> str:
    """An auth config with tenants x per_tenant keys; returns the key in the middle."""
    from pagoda.security.auth import KeyEntry, new_key, now_iso, write_file

    keys, handed = [], []
    for t in range(tenants):
        for _ in range(per_tenant):
            key_id, key, digest = new_key()
            keys.append(KeyEntry(key_id, f"tenant{t}", "bench", digest, created=now_iso()).to_dict())
            handed.append(key)
    write_file(path, {"roles": {"bench": ROLE}, "keys": keys})
    return handed[len(handed) // 2]


def _cpu_seconds(pid: int) -> float:
    """The process's CPU time in ns resolution: its threads' schedstat run times, summed (the
    /proc/PID/stat ticks are 10 ms, too coarse for a few seconds of load)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


async def _requests(base: str, key: str | None, count: int, clients: int = 8) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        async def worker(n: int) -> None:
            for _ in range(n):
                r = await client.post(f"{base}/v1/completions", json=body)
                assert r.status_code == 200, r.text
        await asyncio.gather(*(worker(count // clients) for _ in range(clients)))


async def _streams(base: str, key: str | None, streams: int, tokens: int) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=300, limits=limits, headers=headers) as client:
        async def one() -> int:
            chunks = 0
            async with client.stream("POST", f"{base}/v1/completions", json=body) as answer:
                assert answer.status_code == 200
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
            return chunks
        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def micro(config_path: Path, key: str) -> dict:
    """Per-request work of the access checks, timed in this process (µs)."""
    from pagoda.sampling_params import SamplingParams
    from pagoda.security.access import Access
    from pagoda.security.context import CURRENT, RequestContext, request_context

    access = Access(str(config_path))
    header = f"Bearer {key}"
    params = SamplingParams(max_tokens=16)

    def whole_request() -> None:  # what one request runs through, hooks included
        ctx = RequestContext(access.authenticate(header))
        access.admit_request(ctx.grant, "/v1/completions")
        token = CURRENT.set(ctx)
        c = request_context()
        c.check_model("tiny")
        c.check_max_tokens(16)
        c.admit()
        c.engine_args(0, None)
        c.cap_params(params)
        c.on_engine_done(0, [1] * 10, 16, 0, None)
        c.release()
        CURRENT.reset(token)

    def best(fn, number: int = 20000) -> float:
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    return {"authenticate_us": best(lambda: access.authenticate(header)),
            "authenticate_unknown_key_us": best(lambda: _refused(access, "Bearer pk-000000000000-" + "A" * 43)),
            "whole_request_us": best(whole_request),
            "context_get_without_auth_us": best(request_context, 200000)}


def _refused(access, header: str) -> None:
    try:
        access.authenticate(header)
    except Exception:  # noqa: BLE001 - the 401
        pass


def main() -> None:
    from tiny_models import make_tiny_hf_model

    from pagoda.bench.servers import free_port, running_process
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8)
    ns = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pagoda-auth-bench-"))
    model = make_tiny_hf_model("llama", work / "tiny", seed=0)
    config = work / "auth.yaml"
    key = write_config(config)
    setups = {"none": ([], None), "none-2": ([], None), "auth": (["--auth-config", str(config)], key),
              "auth+audit": (["--auth-config", str(config), "--audit-log", str(work / "audit.jsonl")], key)}
    procs, bases = {}, {}
    with contextlib.ExitStack() as stack:
        for name, (flags, _) in setups.items():
            port = free_port()
            cmd = [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model), "--port", str(port),
                   "--dtype", "float32", "--kv-cache-memory", "0.02", "--served-model-name", "tiny",
                   "--max-num-seqs", str(ns.streams), "--log-level", "warning", *flags]
            bases[name], procs[name] = stack.enter_context(running_process(cmd, port, ready_path="/health",
                                                                           timeout_s=180))
        for name, (_, k) in setups.items():  # warm-up
            asyncio.run(_requests(bases[name], k, 16))
            asyncio.run(_streams(bases[name], k, 4, 8))
        runs = []
        names = list(setups)
        for repeat in range(ns.repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # each goes first in turn
                k = setups[name][1]
                pid, base = procs[name].pid, bases[name]
                cpu, start = _cpu_seconds(pid), time.perf_counter()
                asyncio.run(_requests(base, k, ns.requests))
                req_wall, req_cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu
                cpu, start = _cpu_seconds(pid), time.perf_counter()
                chunks = asyncio.run(_streams(base, k, ns.streams, ns.tokens))
                tok_wall, tok_cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu
                total = ns.streams * ns.tokens
                runs.append({"setup": name, "repeat": repeat, "requests": ns.requests,
                             "requests_per_s": ns.requests / req_wall,
                             "server_cpu_ms_per_request": 1000 * req_cpu / ns.requests,
                             "tokens": total, "chunks": chunks, "tokens_per_s": total / tok_wall,
                             "server_cpu_us_per_token": 1e6 * tok_cpu / total})
                r = runs[-1]
                print(f"{name:>10}: {r['requests_per_s']:7.1f} req/s, {r['server_cpu_ms_per_request']:.3f} ms CPU/req; "
                      f"{r['tokens_per_s']:7.1f} tok/s, {r['server_cpu_us_per_token']:.1f} µs CPU/token", flush=True)
    metrics = ("requests_per_s", "server_cpu_ms_per_request", "tokens_per_s", "server_cpu_us_per_token")
    summary = {}
    for name in setups:
        mine = [r for r in runs if r["setup"] == name]
        summary[name] = {m: statistics.median(r[m] for r in mine) for m in metrics}
    for name in ("none-2", "auth", "auth+audit"):  # the median over repeats of each repeat's ratio to `none`
        pairs = [(r, n) for r in runs if r["setup"] == name for n in runs
                 if n["setup"] == "none" and n["repeat"] == r["repeat"]]
        summary[name]["ratio_vs_none"] = {m: statistics.median(r[m] / n[m] for r, n in pairs) for m in metrics}
    micro_us = micro(config, key)
    print(json.dumps({"summary": summary, "micro_us": micro_us}, indent=2))
    out = HERE / "results" / f"auth-overhead-{date.today()}.json"
    out.write_text(json.dumps({"date": str(date.today()), "cpu_model": cpu_model(), "cpu_flags": benchmark_cpu_flags(),
                               "keys": 1000, "role": ROLE, "args": vars(ns), "summary": summary, "micro_us": micro_us,
                               "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
