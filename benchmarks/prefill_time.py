"""Prefill time through ``LLM.generate`` (``max_tokens=1``, no prefix cache): a burst of prompts
that arrive together (issue 13's "64 arrivals at once", offline) and single prompts of growing
length (beside ``llama-bench -p 512,2048 -n 0``, llama.cpp's prompt processing).

    python benchmarks/prefill_time.py                          # gguf: 64 x 128, then 512 and 2048 tokens
    python benchmarks/prefill_time.py --passes 3 --lengths 512 --quantization none

Prompts are random token ids (the same every run). Prints each pass's seconds, the best single
prompt of ``--passes`` per length, and with ``--save`` writes them as JSON with the CPU's flags.
To compare two trees, run it from each in turn (a worktree and its own ``PAGODA_HOME`` for its
kernel build): this machine's noise between minutes is larger than most changes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's pagoda


def _prompts(rng: random.Random, count: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]} for _ in range(count)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="gguf", help="gguf, int8, int4 or none")
    ap.add_argument("--burst", default="64x128", help="COUNTxLENGTH prompts generated together ('' to skip)")
    ap.add_argument("--lengths", default="512,2048", help="single prompts' lengths ('' to skip)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--save", type=Path)
    ns = ap.parse_args()

    from pagoda import LLM, SamplingParams
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    llm = LLM(model=ns.model, quantization=None if ns.quantization == "none" else ns.quantization,
              kv_cache_memory=1.0, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    llm.generate(_prompts(rng, 4, 64), params, use_tqdm=False)  # warm: kernels, caches
    result: dict = {"date": str(date.today()), "command": " ".join(sys.argv), "cpu": cpu_model(),
                    "cpu_flags": benchmark_cpu_flags(), "burst": None, "single": {}}
    if ns.burst:
        count, length = (int(v) for v in ns.burst.split("x"))
        prompts = _prompts(rng, count, length)
        seconds = []
        for _ in range(ns.passes):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
            print(f"burst {count} x {length}: {seconds[-1]:.3f} s", flush=True)
        result["burst"] = {"count": count, "length": length, "seconds": seconds}
    for length in (int(v) for v in ns.lengths.split(",") if v):
        best = min(_timed(llm, _prompts(rng, 1, length), params) for _ in range(ns.passes))
        print(f"one prompt of {length}: {best * 1000:.0f} ms, {length / best:.0f} tok/s", flush=True)
        result["single"][length] = {"best_s": best, "tok_s": length / best}
    if ns.save:
        ns.save.write_text(json.dumps(result, indent=1))
        print(f"wrote {ns.save}")
    return 0


def _timed(llm, prompts: list[dict], params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
