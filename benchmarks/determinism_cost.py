"""What deterministic (batch-invariant) inference costs, on vs off in one run, SmolLM2-135M fp32.

    python benchmarks/determinism_cost.py     # writes results/determinism-cost-<date>.json

One engine (prefix caching off, so every prompt token is computed) switches between the two
modes between measurements (``ModelRunner.deterministic``, what ``--deterministic`` sets), and
the measurements alternate on / off so that both see the same machine load:

- kernel: pagoda::linear's batch-invariant GEMM against at::linear (MKL) in GFLOP/s, SmolLM2's
  projection shapes (K x N) at M = 1 ... 2048 rows, best of calls alternating between the two
  (``--only-kernels --kernel-threads 1,2`` runs just this table, into determinism-gemm-<date>.json);
- prefill: one prompt of 128 / 512 / 2048 random tokens, max_tokens=1 (the time of the steps);
- decode: the median step at batch 1 / 4 / 64 (128-token prompts, greedy, ignore_eos);
- offline: LLM.generate of 64 prompts x 128 random tokens, 128 output tokens each (tokens/s).
Off means the previous behaviour: MKL above 32 rows, SDPA for prefill chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}






def best_time(fn, min_seconds=0.3, min_reps=3, max_reps=200) -> float:
    fn()
    best, start, n = float("inf"), time.perf_counter(), 0
    while (time.perf_counter() - start < min_seconds or n < min_reps) and n < max_reps:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best


def best_pair(f, g, seconds: float) -> tuple[float, float]:
    """The best time of each of two functions, called alternately (so both see the same load)."""
    f(), g()
    bf = bg = float("inf")
    start, n = time.perf_counter(), 0
    while (time.perf_counter() - start < seconds or n < 5) and n < 400:
        t = time.perf_counter()
        f()
        bf = min(bf, time.perf_counter() - t)
        t = time.perf_counter()
        g()
        bg = min(bg, time.perf_counter() - t)
        n += 1
    return bf, bg


def kernel_rows(ms: list[int], seconds: float) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pagoda.layers.backend import select_backend
    from pagoda.layers.cpu_kernels import load_cpu_kernels

    ops = load_cpu_kernels()
    rows = []
    for name, (K, N) in SHAPES.items():
        w = torch.randn(N, K)
        for M in ms:
            if name == "head" and M > 128:
                continue  # logits are computed for the sampling rows only
            x = torch.randn(M, K)
            with select_backend("cpu").batch_invariant(True):
                ours, mkl = best_pair(lambda: ops.linear(x, w), lambda: F.linear(x, w), seconds)
            gflop = 2 * M * N * K / 1e9
            rows.append({"shape": name, "K": K, "N": N, "M": M, "invariant_gflops": round(gflop / ours, 1),
                         "mkl_gflops": round(gflop / mkl, 1), "ratio": round(mkl / ours, 2)})
            print(f"  {name:8s} K={K:5d} N={N:6d} M={M:5d}: invariant {gflop / ours:6.1f} GFLOP/s, "
                  f"MKL {gflop / mkl:6.1f} GFLOP/s ({mkl / ours:.2f}x)", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="alternating on/off repetitions of each measurement")
    p.add_argument("--prefill", default="128,512,2048")
    p.add_argument("--batches", default="1,4,64")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--offline", type=int, default=64, help="prompts of the offline run (0: skip)")
    p.add_argument("--offline-reps", type=int, default=1)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--tag", default="", help="added to the result file's name")
    p.add_argument("--only-kernels", action="store_true")
    p.add_argument("--kernel-threads", default=None, help="thread counts for the GEMM table (default: --threads)")
    p.add_argument("--kernel-seconds", type=float, default=1.0, help="time per GEMM measurement")
    args = p.parse_args()

    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    torch.set_num_threads(args.threads)
    result = {"date": date.today().isoformat(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(), "threads": args.threads, "torch": torch.__version__}
    print(f"{result['cpu']}, {args.threads} threads; flags: {' '.join(result['cpu_flags'])}", flush=True)
    if not args.skip_kernels:
        result["kernel"] = {}
        for threads in [int(t) for t in (args.kernel_threads or str(args.threads)).split(",")]:
            torch.set_num_threads(threads)
            print(f"GEMM: the batch-invariant kernel vs at::linear (MKL), {threads} threads", flush=True)
            result["kernel"][threads] = kernel_rows([1, 4, 32, 128, 512, 2048], args.kernel_seconds)
        torch.set_num_threads(args.threads)
    if args.only_kernels:
        return _write(result, "determinism-gemm")

    llm = LLM(model="smollm2-135m-instruct", dtype="float32", kv_cache_memory=1.0, enable_prefix_caching=False,
              deterministic=True)
    engine, runner = llm.engine, llm.engine.core.runner
    rng = random.Random(0)

    def prompt(n):
        return {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]}

    def modes():
        for rep in range(args.reps):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                runner.deterministic = on
                yield on

    print("prefill (one prompt, max_tokens=1)", flush=True)
    result["prefill_ms"] = {}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for n in [int(x) for x in args.prefill.split(",") if x]:
        times = {True: [], False: []}
        for on in modes():
            engine.add_request(f"p{n}-{on}-{len(times[on])}", prompt(n), one)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times[on].append(time.perf_counter() - start)
        row = {"on": 1e3 * min(times[True]), "off": 1e3 * min(times[False])}
        result["prefill_ms"][n] = {k: round(v, 1) for k, v in row.items()}
        print(f"  {n:5d} tokens: on {row['on']:8.1f} ms, off {row['off']:8.1f} ms ({row['on'] / row['off']:.3f}x)",
              flush=True)

    print(f"decode (median step of {args.decode_steps}, 128-token prompts)", flush=True)
    result["decode_step_ms"] = {}
    for b in [int(x) for x in args.batches.split(",") if x]:
        times = {True: [], False: []}
        for on in modes():
            params = SamplingParams(temperature=0, max_tokens=args.decode_steps, ignore_eos=True)
            for i in range(b):
                engine.add_request(f"d{b}-{on}-{len(times[on])}-{i}", prompt(128), params)
            steps = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            prefill_steps = -(-b * 128 // 2048) + 1  # the budget is 2048 tokens a step
            times[on].append(statistics.median(steps[prefill_steps:-1]))
        row = {"on": 1e3 * min(times[True]), "off": 1e3 * min(times[False])}
        result["decode_step_ms"][b] = {k: round(v, 2) for k, v in row.items()}
        print(f"  batch {b:3d}: on {row['on']:7.2f} ms, off {row['off']:7.2f} ms ({row['on'] / row['off']:.3f}x)",
              flush=True)

    if args.offline:
        n = args.offline
        print(f"offline: LLM.generate, {n} prompts x 128 tokens, 128 output tokens", flush=True)
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        tput = {True: [], False: []}
        for rep in range(args.offline_reps):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                runner.deterministic = on
                prompts = [prompt(128) for _ in range(n)]
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                tput[on].append(tokens / elapsed)
        row = {"on": max(tput[True]), "off": max(tput[False])}
        result["offline_output_tokens_per_s"] = {k: round(v, 1) for k, v in row.items()}
        print(f"  on {row['on']:.1f} tok/s, off {row['off']:.1f} tok/s ({row['on'] / row['off']:.3f}x)", flush=True)

    return _write(result, "determinism-cost" + (f"-{args.tag}" if args.tag else ""))


def _write(result: dict, stem: str) -> int:
    result["loadavg"] = os.getloadavg()
    path = HERE / "results" / f"{stem}-{date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
