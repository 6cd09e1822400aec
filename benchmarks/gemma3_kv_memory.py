"""KV cache memory of Gemma 3 at long context: the hybrid cache (the local layers' own block
tables, which give back the blocks their window has passed) against one table for every layer.

    python benchmarks/gemma3_kv_memory.py [--lengths 1024 4096 8192] [--output 8] [--chunks 2048 512]

The real gemma3-270m from the catalog (18 layers: 15 local with a 512-token window, 3 global;
1 KV head of 256), fp32, the GGUF fast path (--quantization gguf). For each prompt length, one
request (a prompt of that many tokens, then --output greedy tokens) runs alone in a fresh
engine, with and without --disable-hybrid-kv-cache-manager, and with the prefix cache off (so
every block in use is the request's); the hybrid cache once per prefill chunk size
(--max-num-batched-tokens: a chunk's blocks are given back only after its step, so the chunk
sets the peak). Measured: the most pool blocks in use at once (tracked at every allocation),
the blocks the request holds when it finishes (what a long conversation keeps while it
decodes), their bytes (a pool block holds every slot of a group: 3 layers' K/V of 16 tokens in
the hybrid cache, 18 layers' otherwise), and whether the greedy tokens are the same.
Writes results/gemma3-kv-memory-<date>.json with the CPU flags and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent


def measure(model: Path, length: int, output: int, hybrid: bool, chunk: int) -> dict:
    from pagoda import LLM, SamplingParams
    from pagoda.core.block_pool import BlockPool
    from pagoda.core.kv_cache_manager import KVCacheManager

    peak, at_finish = [0], [0]
    allocate, free = BlockPool.allocate, KVCacheManager.free

    def tracked(self, n):
        blocks = allocate(self, n)
        peak[0] = max(peak[0], self.num_used_blocks)
        return blocks

    def finishing(self, request, finished=False):
        at_finish[0] = self.pool.num_used_blocks
        return free(self, request, finished)

    BlockPool.allocate, KVCacheManager.free = tracked, finishing
    try:
        llm = LLM(model=str(model), dtype="float32", quantization="gguf", kv_cache_memory=1.0,
                  enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid,
                  max_num_batched_tokens=chunk, max_model_len=length + output + 16)
        worker = llm.engine.core.executor.driver_worker
        per_block = worker._bytes_per_block(worker.model.config.num_kv_heads)
        tokens = [(i * 7919) % 200_000 + 100 for i in range(length)]  # arbitrary ids above the special tokens
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0, max_tokens=output,
                                                                          ignore_eos=True), use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        groups = worker.kv_groups
        return {"length": length, "hybrid": hybrid, "chunk": chunk, "groups": groups.num_groups,
                "slots_per_block": groups.slots_per_block, "bytes_per_block": per_block,
                "peak_blocks": peak[0], "peak_mib": peak[0] * per_block / 2**20,
                "finish_blocks": at_finish[0], "finish_mib": at_finish[0] * per_block / 2**20,
                "seconds": round(seconds, 2), "tokens": out.outputs[0].token_ids}
    finally:
        BlockPool.allocate, KVCacheManager.free = allocate, free


def main() -> None:
    from pagoda.loader import catalog
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--output", type=int, default=8)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 512], help="prefill chunk sizes (the first: also the one-table run's)")
    args = parser.parse_args()
    model = catalog.pull("gemma3-270m", quiet=True)
    rows = []
    for length in args.lengths:
        one = measure(model, length, args.output, False, args.chunks[0])
        for chunk in args.chunks:
            hybrid = measure(model, length, args.output, True, chunk)
            rows.append({"length": length, "chunk": chunk, "one_table": one, "hybrid": hybrid,
                         "peak_saved_pct": 100 * (1 - hybrid["peak_mib"] / one["peak_mib"]),
                         "finish_saved_pct": 100 * (1 - hybrid["finish_mib"] / one["finish_mib"]),
                         "same_tokens": one["tokens"] == hybrid["tokens"]})
    record = {"date": date.today().isoformat(), "command": "python benchmarks/gemma3_kv_memory.py "
              + " ".join(f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
              "model": "gemma3-270m", "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(), "rows": rows}
    out = HERE / "results" / f"gemma3-kv-memory-{record['date']}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("| prompt + output | prefill chunk | one table: MiB (peak = at finish) | hybrid: peak MiB | saved | "
          "hybrid: at finish MiB | saved | same tokens | s (one / hybrid) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: |")
    for r in rows:
        one, hy = r["one_table"], r["hybrid"]
        print(f"| {r['length']} + {args.output} | {r['chunk']} | {one['peak_mib']:.1f} | {hy['peak_mib']:.1f} | "
              f"{r['peak_saved_pct']:.0f} % | {hy['finish_mib']:.1f} | {r['finish_saved_pct']:.0f} % | "
              f"{r['same_tokens']} | {one['seconds']} / {hy['seconds']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
