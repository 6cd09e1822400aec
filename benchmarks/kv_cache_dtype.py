"""--kv-cache-dtype: the decode attention kernel's time and the cache's bytes per token for each
cache dtype (int8 and fp8 with their per-token, per-head scales), for SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64, 30 layers).

    python benchmarks/kv_cache_dtype.py [--batches 1 64] [--contexts 256 1024 4096] [--threads 2]

One layer's `paged_decode_attention` (pagoda's C++ kernel, fp32 queries) over a cache of each
dtype, every row at the same context length, blocks of 16 scattered over the pool; best of
--repeats calls. Quality (perplexity, greedy agreement) comes from benchmarks/quality.py's
`fp32-chunked`, `kv-bf16`, `kv-fp16`, `kv-int8`, `kv-fp8` and `kv-fp8-e5m2` modes. Writes results/kv-cache-dtype-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch

from pagoda.layers.backend import quantize_rows
from pagoda.worker.kv_cache import SCALED_KV_DTYPES, bytes_per_block

HERE = Path(__file__).parent
HQ, HKV, D, LAYERS, BS = 9, 3, 64, 30, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def time_attention(ops, batch: int, context: int, dtype: torch.dtype, repeats: int) -> float:
    blocks_per_seq = -(-context // BS)
    num_blocks = batch * blocks_per_seq
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, HKV, BS, D, generator=g)
    v_cache = torch.randn(num_blocks, HKV, BS, D, generator=g)
    scales = [None, None]
    if dtype in SCALED_KV_DTYPES:
        (k_cache, k_scales), (v_cache, v_scales) = quantize_rows(k_cache, dtype), quantize_rows(v_cache, dtype)
        scales = [k_scales.contiguous(), v_scales.contiguous()]
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    tables = torch.randperm(num_blocks, generator=g).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, HQ, D, generator=g)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5, 0, *scales)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    from pagoda.layers.cpu_kernels import load_cpu_kernels
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_kernels()
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            row = {"batch": batch, "context": context}
            for name, dtype in DTYPES.items():
                row[f"{name}_ms"] = time_attention(ops, batch, context, dtype, args.repeats)
            rows.append(row)
    per_token = {name: bytes_per_block(LAYERS, 1, HKV, D, dtype) for name, dtype in DTYPES.items()}
    record = {"date": date.today().isoformat(), "command": "python benchmarks/kv_cache_dtype.py", "args": vars(args),
              "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(), "shape": {"hq": HQ, "hkv": HKV, "d": D, "block": BS},
              "bytes_per_token_smollm2": per_token, "rows": rows}
    out = HERE / "results" / f"kv-cache-dtype-{record['date']}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("bytes per token (SmolLM2, 30 layers):", {k: f"{v / 1024:.1f} KiB" for k, v in per_token.items()})
    narrow = [name for name in DTYPES if name != "float32"]
    print("| batch | context | float32 ms | " + " | ".join(f"{n} ms (/ fp32)" for n in narrow) + " |")
    print("| ---: | ---: | ---: | " + " | ".join("---:" for _ in narrow) + " |")
    for r in rows:
        fp32 = r["float32_ms"]
        cells = " | ".join(f"{r[n + '_ms']:.3f} ({r[n + '_ms'] / fp32:.2f})" for n in narrow)
        print(f"| {r['batch']} | {r['context']} | {fp32:.3f} | {cells} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
