"""Where a batched decode step's time goes: the fused C++ decoder stack replayed op by op.

    python benchmarks/decode_stack_ops.py --model /path/1b-Q4_K_M.gguf --batch 64 --prompt-len 128 \
        --save benchmarks/results/decode-stack-ops-<date>.json

The stack (pagoda/csrc/decode_layers.cpp) runs a whole decode step's layers in one call, so a
profiler sees one op. Here every decode step of `--batch` rows first replays the same ops in the
same order from Python on copies of the step's inputs (each timed on its own), then runs the
stack itself (timed as a whole). The replay writes the same K/V to the same slots, so the step's
result is unchanged. Milliseconds per step, the median over `--steps` steps; the replay's sum
beside the whole call shows what the split between ops leaves out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from pagoda.layers.superblocks import PACKED


def replay(stack, hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, meta) -> dict[str, float]:
    """The stack's ops for one step on copies of its inputs: seconds per kind of op."""
    ops, cfg, times = stack.ops, stack.cfg, defaultdict(float)
    rows, x, res = hidden.shape[0], hidden.clone(), residual.clone()
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def timed(kind: str, fn):
        start = time.perf_counter()
        out = fn()
        times[kind] += time.perf_counter() - start
        return out

    for layer, (k_cache, v_cache) in enumerate(zip(stack.k_caches, stack.v_caches)):
        w, types = stack.weights[6 * layer:6 * layer + 6], stack.block_types[4 * layer:4 * layer + 4]
        packed = stack.packed[4 * layer:4 * layer + 4] if stack.packed else [None] * 4
        project = lambda i, a, j: ops.block_matmul(a, w[i], types[j], packed[j]) if types[j] >= 0 \
            else ops.linear(a, w[i], packed[j])  # noqa: E731
        timed("norm", lambda: ops.fused_add_rms_norm(x, res, w[0], cfg.rms_norm_eps))
        qkv = timed("qkv", lambda: project(1, x, 0))
        q = qkv.narrow(1, 0, q_size).view(rows, cfg.num_heads, cfg.head_dim)
        k = qkv.narrow(1, q_size, kv_size).view(rows, cfg.num_kv_heads, cfg.head_dim)
        v = qkv.narrow(1, q_size + kv_size, kv_size).view(rows, cfg.num_kv_heads, cfg.head_dim)
        rotary = stack.rotary
        timed("rotary", lambda: ops.rotary_embedding(q, k, positions, rotary.cos_cache, rotary.sin_cache))
        timed("kv write", lambda: ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping))
        window = (cfg.sliding_windows[layer] or 0) if cfg.sliding_windows else 0
        attn = timed("attention", lambda: ops.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, cfg.head_dim ** -0.5, window))
        o = timed("o", lambda: project(2, attn.view(rows, q_size), 1))
        timed("norm", lambda: ops.fused_add_rms_norm(o, res, w[3], cfg.rms_norm_eps))
        gate_up = timed("gate_up", lambda: project(4, o, 2))
        x = timed("silu * up, down", lambda: ops.silu_mul_superblock_gemm(gate_up, w[5]) if types[3] == PACKED
                  else project(5, ops.silu_and_mul(gate_up), 3))
    return times


def main() -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.models import decode_stack
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--save", type=Path)
    ns = ap.parse_args()

    steps: list[dict[str, float]] = []
    original = decode_stack.DecodeStack.__call__

    def measured(self, hidden, residual, positions, meta):
        if hidden.shape[0] != ns.batch:
            return original(self, hidden, residual, positions, meta)
        times = replay(self, hidden, residual, positions, meta)
        start = time.perf_counter()
        out = original(self, hidden, residual, positions, meta)
        times["whole stack call"] = time.perf_counter() - start
        steps.append(times)
        return out

    decode_stack.DecodeStack.__call__ = measured
    llm = LLM(ns.model, kv_cache_memory=ns.kv_cache_memory)
    prompts = [{"prompt_token_ids": [1] + [100 + (i * 37 + j) % 30000 for j in range(ns.prompt_len - 1)]}
               for i in range(ns.batch)]
    params = SamplingParams(max_tokens=ns.steps + 1, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels built, pages touched
    steps.clear()
    llm.generate(prompts, params, use_tqdm=False)
    kinds = list(steps[0])
    ms = {kind: round(1e3 * statistics.median(s[kind] for s in steps), 2) for kind in kinds}
    parts = round(sum(v for k, v in ms.items() if k != "whole stack call"), 2)
    for kind, value in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"{kind:18s} {value:8.2f} ms")
    print(f"{'sum of the ops':18s} {parts:8.2f} ms")
    if ns.save:
        ns.save.write_text(json.dumps({
            "model": ns.model, "batch": ns.batch, "prompt_len": ns.prompt_len, "steps": len(steps),
            "threads": torch.get_num_threads(), "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(),
            "ms_per_step": ms, "sum_of_ops_ms": parts}, indent=1))
        print(f"wrote {ns.save}")


if __name__ == "__main__":
    main()
