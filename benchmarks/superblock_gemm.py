"""The super-block GEMM per kernel build, side by side: GOP/s at Llama-3.2-1B's projection shapes.

    python benchmarks/superblock_gemm.py --levels native,native-deterministic,avx512-vnni --rounds 3

Each build (a ``PAGODA_KERNEL_ISA`` level; ``native`` takes the AMX tiles on a CPU with AMX-INT8,
and from 32 rows the bf16 route where it has AMX-BF16; ``-deterministic`` runs a level under batch
invariance, which keeps the integer kernels at every row count) runs in a process of its own, since two builds register the same ops; the levels take turns,
``--rounds`` times, and each cell is the best call of all its rounds (other work on a shared
machine only adds time). GOP/s = 2 M N K / 1e9 per call. The weights are random blocks of each
format (speed does not depend on the values), warm in the caches between calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # this tree's pagoda, not whichever one is installed
# (name, N, K, format): Llama-3.2-1B's projections as a Q4_K_M file holds them
SHAPES = (("gate_up", 16384, 2048, "Q4_K"), ("down", 2048, 8192, "Q6_K"), ("qkv", 3072, 2048, "Q4_K"),
          ("o", 2048, 2048, "Q8_0"))

_CHILD = """
import json, sys, time
import numpy as np, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
from pagoda.layers.cpu_kernels import load_cpu_kernels
from superblock_data import TYPE_IDS, random_blocks
ops, (shapes, ms, threads, budget, invariant) = load_cpu_kernels(), json.loads(sys.argv[2])
torch.set_num_threads(threads)
ops.set_batch_invariant(invariant)
rng, cells = np.random.default_rng(0), []
for name, n, k, qtype in shapes:
    packed = ops.superblock_repack([torch.from_numpy(random_blocks(qtype, n, k, rng))], [TYPE_IDS[qtype]], k)
    for m in ms:
        x = torch.randn(m, k)
        ops.superblock_gemm(x, packed, n)
        best, start = float("inf"), time.perf_counter()
        while time.perf_counter() - start < budget:
            t = time.perf_counter(); ops.superblock_gemm(x, packed, n); best = min(best, time.perf_counter() - t)
        cells.append({"shape": name, "n": n, "k": k, "format": qtype, "m": m, "seconds": best})
print(json.dumps({"isa": ops.superblock_isa(), "cells": cells}))
"""


def run_level(level: str, ms: list[int], threads: int, budget: float) -> dict:
    build = level.removesuffix("-deterministic")
    env = {**os.environ, "PAGODA_KERNEL_ISA": build}
    args = json.dumps([SHAPES, ms, threads, budget, level.endswith("-deterministic")])
    out = subprocess.run([sys.executable, "-c", _CHILD, str(HERE.parent), args], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="native,native-deterministic,avx512-vnni",
                        help="PAGODA_KERNEL_ISA levels to compare (-deterministic: under batch invariance)")
    parser.add_argument("--ms", default="1,4,8,16,32,64,128", help="activation row counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of calls per cell and round")
    parser.add_argument("--save", default=str(HERE / "results" / f"superblock-gemm-{date.today()}.json"))
    args = parser.parse_args()
    levels, ms = args.levels.split(","), [int(m) for m in args.ms.split(",")]
    best: dict[tuple, float] = {}
    isa: dict[str, str] = {}
    for _ in range(args.rounds):
        for level in levels:
            result = run_level(level, ms, args.threads, args.budget)
            isa[level] = result["isa"]
            for c in result["cells"]:
                key = (level, c["shape"], c["m"])
                best[key] = min(best.get(key, float("inf")), c["seconds"])
    rows = []
    print("| shape (N x K, format) | M | " + " | ".join(f"{lv} ({isa[lv]}) GOP/s" for lv in levels) + " | ratio |")
    print("| --- | ---: |" + " ---: |" * (len(levels) + 1))
    for name, n, k, qtype in SHAPES:
        for m in ms:
            gops = [2 * m * n * k / best[(lv, name, m)] / 1e9 for lv in levels]
            rows.append({"shape": name, "n": n, "k": k, "format": qtype, "m": m,
                         "gops": dict(zip(levels, gops))})
            print(f"| {name} ({n} x {k}, {qtype}) | {m} | " + " | ".join(f"{g:.0f}" for g in gops)
                  + f" | {gops[0] / gops[-1]:.2f}x |")
    from pagoda.platform import cpu_flags

    Path(args.save).write_text(json.dumps({"command": " ".join(sys.argv), "isa": isa, "threads": args.threads,
                                           "cpu_flags": sorted(cpu_flags()), "rows": rows}, indent=1))
    print(f"saved {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
