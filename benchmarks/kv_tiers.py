"""KV tiers (issue 43): time to first token of a long shared prefix computed cold, promoted from the
host-memory tier, from the disk tier, and from disk after a restart; and what the tiers cost a
workload that never hits them.

    python benchmarks/kv_tiers.py [--model smollm2-135m-instruct] [--lengths 1024 4096 8000]

Offline (``pagoda.LLM``, in process): TTFT is the wall time of a request with ``max_tokens=1``, a
prefix of L random tokens plus the same 8 tokens (so every request computes a few). Memory tier:
the prefix cache is reset (its blocks go down to host memory) and a 16-token request applies those
copies before the timed one. Disk tier: an engine with ``--kv-offload-memory 0`` over the same
directory (first request: after a restart; then, reset again, the disk tier in the same process).
Another replica: where `valkey-server` or `redis-server` is installed, the first engine also writes
through to one this script starts, and a second engine with only ``--kv-offload-url`` (no memory
tier, no directory) reads the prefix from it over TCP, as a replica on another host would.
Every hit's first token is compared with the cold one (``*_same_token``). Overhead: the same batch of prompts that
never share a block (--overhead-prompts x 1024 tokens, 32 tokens out) with tiers off and on
(memory and disk) under each write policy, alternating within each round. Writes --save
(results/kv-tiers-<date>.json by default).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path

from pagoda import LLM, SamplingParams

HERE = Path(__file__).parent
ONE = SamplingParams(temperature=0.0, max_tokens=1)
SUFFIX = list(range(200, 208))  # the tokens after the prefix: the same prompt every time, 8 tokens to compute


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _ttft(llm: LLM, tokens: list[int]) -> tuple[float, int, int]:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], ONE, use_tqdm=False)[0]
    return time.perf_counter() - start, out.outputs[0].token_ids[0], out.num_cached_tokens


def _push_down(llm: LLM) -> None:
    """Evict the prefix cache into the tiers, and run the copies out before timing anything."""
    llm.engine.core.kv_manager.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": _tokens(999, 16)}], ONE, use_tqdm=False)


@contextmanager
def _valkey() -> Iterator[str | None]:
    """redis://127.0.0.1:PORT of a Valkey / Redis server started for the run, or None if there is none."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no",
                             "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # polling for the server's port
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


def ttft_rows(model: str, lengths: list[int], kv_dir: Path, store_url: str | None = None) -> list[dict]:
    base = dict(model=model, max_model_len=8192, kv_cache_memory=1.0)
    rows = {n: {"prefix_tokens": n} for n in lengths}
    with LLM(kv_offload_memory=4.0, kv_offload_dir=str(kv_dir), kv_offload_url=store_url, **base) as llm:
        llm.generate([{"prompt_token_ids": _tokens(998, 64)}], ONE, use_tqdm=False)  # warm up
        for n in lengths:
            prefix = _tokens(n, n)
            rows[n]["cold_s"], rows[n]["token"], _ = _ttft(llm, prefix + SUFFIX)
            llm.engine.core.kv_tiers.flush()  # the written-through files, before the restart below
            _push_down(llm)
            rows[n]["memory_s"], token, cached = _ttft(llm, prefix + SUFFIX)
            rows[n]["memory_cached"] = cached
            rows[n]["memory_same_token"] = token == rows[n]["token"]
    with LLM(kv_offload_memory=0.0, kv_offload_dir=str(kv_dir), **base) as llm:  # a restart
        for n in lengths:
            prefix = _tokens(n, n)
            rows[n]["restart_s"], token, rows[n]["restart_cached"] = _ttft(llm, prefix + SUFFIX)
            rows[n]["restart_same_token"] = token == rows[n]["token"]
        for n in lengths:
            _push_down(llm)
            rows[n]["disk_s"], token, rows[n]["disk_cached"] = _ttft(llm, _tokens(n, n) + SUFFIX)
            rows[n]["disk_same_token"] = token == rows[n]["token"]
    if store_url is not None:
        with LLM(kv_offload_memory=0.0, kv_offload_url=store_url, **base) as llm:  # another replica
            for n in lengths:
                rows[n]["replica_s"], token, rows[n]["replica_cached"] = _ttft(llm, _tokens(n, n) + SUFFIX)
                rows[n]["replica_same_token"] = token == rows[n]["token"]
    return list(rows.values())


OVERHEAD_MODES = ("off", "write_through", "write_through_selective")


def overhead(model: str, num_prompts: int, rounds: int, kv_dir: Path) -> dict:
    """A workload that never hits, tiers off and on (1 GiB of memory and a directory) under each
    write policy, the modes alternating within each round so the machine's drift hits all alike."""
    prompts = [{"prompt_token_ids": _tokens(5000 + i, 1024)} for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    times: dict[str, list[float]] = {mode: [] for mode in OVERHEAD_MODES}
    for r in range(rounds):
        for mode in OVERHEAD_MODES:
            tiers = {} if mode == "off" else dict(kv_offload_memory=1.0, kv_offload_dir=str(kv_dir / f"r{r}-{mode}"),
                                                  kv_offload_write_policy=mode)
            with LLM(model=model, max_model_len=8192, kv_cache_memory=1.0, **tiers) as llm:
                llm.generate(prompts[:1], params, use_tqdm=False)  # warm up (also the one block shared)
                fresh = [{"prompt_token_ids": _tokens(7000 + r * 100 + i, 1024)} for i in range(num_prompts)]
                start = time.perf_counter()
                llm.generate(fresh, params, use_tqdm=False)
                times[mode].append(time.perf_counter() - start)
    return {"prompts": num_prompts, "prompt_tokens": 1024, "max_tokens": 32, "seconds": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    ap.add_argument("--overhead-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip", choices=("ttft", "overhead"), default=None, help="leave one of the two parts out")
    ap.add_argument("--save", type=Path, default=HERE / "results" / f"kv-tiers-{date.today()}.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kv-tiers-"))
    rows, cost = [], None
    try:
        if args.skip != "ttft":
            with _valkey() as url:
                rows = ttft_rows(args.model, args.lengths, work / "ttft", url)
        for r in rows:
            print(f"{r['prefix_tokens']:>5} tokens: cold {r['cold_s']:.2f} s, memory {r['memory_s']:.3f} s, "
                  f"disk {r['disk_s']:.3f} s, after restart {r['restart_s']:.3f} s "
                  f"({r['cold_s'] / r['restart_s']:.1f}x sooner), another replica {r.get('replica_s', float('nan')):.3f} s; "
                  f"cached {r['memory_cached']}/{r['disk_cached']}/{r['restart_cached']}/{r.get('replica_cached')}; "
                  f"same first token {r['memory_same_token']}/{r['disk_same_token']}/{r['restart_same_token']}/"
                  f"{r.get('replica_same_token')}", flush=True)
        if args.skip != "overhead":
            cost = overhead(args.model, args.overhead_prompts, args.rounds, work / "overhead")
            print("never-hit workload, seconds: " + "; ".join(f"{m} {cost['seconds'][m]}" for m in OVERHEAD_MODES))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = args.save
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "ttft": rows, "overhead": cost}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
