"""The tile GEMM on repacked blocks against block_matmul's other routes, at SmolLM2's shapes.

    python benchmarks/block_gemm_tiles.py                    # writes results/block-gemm-tiles-<date>.json
    python benchmarks/block_gemm_tiles.py --ms 1,64 --threads 1

For each projection ([N, K] = out x in, Q4_1 as in SmolLM2's GGUF; the head Q8_0) and row count
M, GOP/s (2 M N K / 1e9 per call) of:

- ``tiles``: ``block_matmul`` given the weight repacked into tiles (``block_repack_tiles``);
- ``blocks``: ``block_matmul`` as it runs without them: the integer kernel below 16 rows and, from
  16, oneDNN's bf16 GEMM on the copy packed at load where the build's route is bf16 (else the
  weight dequantized per call for MKL's fp32 GEMM).

Each cell is the best of as many calls as fit in ``--budget`` seconds: other work on a shared
machine only adds time. The weights stay warm in the caches between calls, so one-row cells
measure the kernel, not the memory a decode step streams from.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # this tree's pagoda, not whichever one is installed

SHAPES = {"qkv": (960, 576, 3), "o": (576, 576, 3), "gate_up": (3072, 576, 3), "down": (576, 1536, 3),
          "head": (49152, 576, 8)}  # name -> (N, K, ggml block type: 3 Q4_1, 8 Q8_0)


def best_seconds(fn, budget: float) -> float:
    fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < budget:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def blocks_of(n: int, k: int, block_type: int, g: torch.Generator) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    kind = {3: GGMLQuantizationType.Q4_1, 8: GGMLQuantizationType.Q8_0}[block_type]
    w = (torch.randn(n, k, generator=g) * 0.05).numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, kind))).view(torch.uint8).reshape(n, -1).clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,4,16,64,512", help="row counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of calls per cell")
    parser.add_argument("--save", default=str(HERE / "results" / f"block-gemm-tiles-{date.today()}.json"))
    args = parser.parse_args()

    from pagoda.layers.cpu_kernels import kernel_isa, load_cpu_kernels
    from pagoda.layers.packed_weights import bf16_packing_applies
    from pagoda.platform import cpu_flags

    ops = load_cpu_kernels()
    if ops is None:
        print("pagoda's C++ kernels cannot be built here")
        return 1
    torch.set_num_threads(args.threads)
    bf16 = bf16_packing_applies(ops)
    g = torch.Generator().manual_seed(0)
    ms = [int(m) for m in args.ms.split(",")]
    cells = []
    for name, (n, k, block_type) in SHAPES.items():
        blocks = blocks_of(n, k, block_type, g)
        tiles = ops.block_repack_tiles(blocks, block_type, k)
        copy = torch.ops.mkldnn._reorder_linear_weight(ops.block_dequantize(blocks, block_type, k), 64) if bf16 else None
        line = []
        for m in ms:
            x = torch.randn(m, k, generator=g)
            t_tiles = best_seconds(lambda: ops.block_matmul(x, blocks, block_type, tiles), args.budget)
            t_blocks = best_seconds(lambda: ops.block_matmul(x, blocks, block_type, copy if m >= 16 else None), args.budget)
            gop = 2 * m * n * k / 1e9
            cells.append({"shape": name, "n": n, "k": k, "block_type": block_type, "m": m,
                          "tiles_gops": gop / t_tiles, "blocks_gops": gop / t_blocks, "speedup": t_blocks / t_tiles})
            line.append(f"M={m}: {gop / t_tiles:.0f} vs {gop / t_blocks:.0f} ({t_blocks / t_tiles:.2f}x)")
        print(f"{name:8s} " + " | ".join(line), flush=True)
    record = {"date": str(date.today()), "threads": args.threads, "budget_s": args.budget, "kernels": kernel_isa(),
              "tiles_isa": ops.block_gemm_tiles_isa(), "blocks_route_from_16_rows": "bf16 copy" if bf16 else "dequantize + fp32",
              "cpu_flags": sorted(cpu_flags()), "cells": cells}
    Path(args.save).parent.mkdir(parents=True, exist_ok=True)
    Path(args.save).write_text(json.dumps(record, indent=1))
    print(f"saved {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
