"""The machine's memory bandwidth, STREAM-style: the roofline one stream's decode is held to
(each step reads every weight once, so tokens/s <= bandwidth / weight bytes).

    python benchmarks/memory_bandwidth.py            # prints GB/s, writes results/memory-bandwidth-<date>.json

Kernels over arrays far larger than the caches (--mib, default 1,024 MiB each), on torch's threads
(all cores by default, as a decode step runs):
  read    the fastest of: the sum of an array, its max, the dot product of two (a decode step
          reads its weights once, writing nothing)
  copy    b = a            (STREAM's copy: one read, one write)
  triad   a = b + s * c    (STREAM's triad: two reads, one write)
The best of --trials is kept (other work on a shared machine only ever adds time). Bytes moved:
read n (the dot: 2n), copy 2n, triad 3n (writes counted once, as STREAM counts them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def best_seconds(fn, trials: int) -> float:
    fn()  # first touch: page faults belong to no kernel
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(mib: int, trials: int) -> dict[str, float]:
    """GB/s for read, copy and triad over float32 arrays of ``mib`` MiB."""
    n = mib * 2**20 // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)
    nbytes = 4 * n
    # read: the fastest of three read-only kernels (torch's sum ran at ~30 GB/s where BLAS's dot of
    # two arrays read at ~43 on the same 2-core EPYC: the sum's loop, not the memory, was the limit)
    reads = {"sum": nbytes / best_seconds(lambda: a.sum(), trials),
             "amax": nbytes / best_seconds(lambda: a.amax(), trials),
             "dot": 2 * nbytes / best_seconds(lambda: torch.dot(a, b), trials)}
    return {
        "read": max(reads.values()) / 1e9,
        **{f"read_{name}": v / 1e9 for name, v in reads.items()},
        "copy": 2 * nbytes / best_seconds(lambda: b.copy_(a), trials) / 1e9,
        "triad": 3 * nbytes / best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), trials) / 1e9,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="size of each array")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--save", default=None)
    ns = ap.parse_args()
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    if ns.threads:
        torch.set_num_threads(ns.threads)
    result = measure(ns.mib, ns.trials)
    for kind, gbs in result.items():
        print(f"{kind:6s} {gbs:6.1f} GB/s")
    record = {"date": date.today().isoformat(), "command": " ".join(sys.argv), "cpu": cpu_model(),
              "cpu_flags": benchmark_cpu_flags(), "nproc": os.cpu_count(), "threads": torch.get_num_threads(),
              "mib": ns.mib, "gb_per_s": result}
    save = Path(ns.save) if ns.save else HERE / "results" / f"memory-bandwidth-{date.today().isoformat()}.json"
    save.parent.mkdir(parents=True, exist_ok=True)
    save.write_text(json.dumps(record, indent=2))
    print(f"saved {save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
