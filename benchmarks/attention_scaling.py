"""Attention as the context grows: the paged kernel, and the engine beside llama.cpp.

    python benchmarks/attention_scaling.py kernel                 # results/attention-kernel-<date>.json
    python benchmarks/attention_scaling.py engine --llama-batched-bench PATH
                                                                  # results/attention-scaling-<date>.{json,png}

``kernel`` (SmolLM2's attention shapes: 9 query heads, 3 kv heads, head size 64, blocks of 16):
1. A prefill chunk of C tokens over P cached positions, three ways: the paged decode kernel
   reading the blocks in place (one row per token: a chunk up to ``--short-chunk-tokens``), the
   flash-style prefill kernel reading them in place (a longer chunk), and gathering the prefix
   into contiguous K/V for one SDPA call (the torch backend's path). Then a fresh prompt of C
   tokens: causal SDPA over its own K/V against the flash-style kernel.
2. 64 decode rows whose sequences share a P-token prefix: block tables that share the prefix's
   blocks (the kernel reads them once per group of rows) against tables that hold private copies
   of the same keys and values (every row reads its own). Same arithmetic, same bits.

``engine`` (the real SmolLM2, ``--quantization gguf`` by default, prefix caching off):
1. Decode ITL at batch 1 for contexts (prompts) of 512 → 8,000 tokens (the median step once every request decodes).
2. Decode ITL and tok/s at context 512 for batches 1 → 128.
3. Prefill time (TTFT of one request) for prompts of 512 → 8,000 tokens (the requests of 1.).
With ``--llama-batched-bench``, llama.cpp's ``llama-batched-bench`` runs the same points on the
same GGUF file (``-npp`` / ``-npl`` sweeps, ``-ntg`` decode steps), and the plot puts both side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
HQ, HKV, D, BS = 9, 3, 64, 16


def _best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def prefill_over_prefix(ops, P: int, C: int, reps: int) -> dict:
    from pagoda.layers.backend import read_blocks

    total = P + C
    nb = -(-total // BS)
    k_cache = torch.randn(nb + 4, HKV, BS, D)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(nb + 4)[:nb]
    q = torch.randn(C, HQ, D)
    mask = torch.arange(total).unsqueeze(0) <= torch.arange(P, total).unsqueeze(1)

    def gathered():
        keys = read_blocks(k_cache, None, table, q.dtype)[:, :total].unsqueeze(0)
        values = read_blocks(v_cache, None, table, q.dtype)[:, :total].unsqueeze(0)
        return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                              scale=D**-0.5, enable_gqa=True)

    tables, lens = table.expand(C, -1).contiguous(), torch.arange(P + 1, total + 1)

    def paged():
        return ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5, 0)

    def flash():
        return ops.paged_prefill_attention(q, k_cache, v_cache, table, P, D**-0.5, 0)

    reference = gathered().squeeze(0).transpose(0, 1)
    return {"prefix": P, "chunk": C, "gathered_sdpa_ms": _best_ms(gathered, reps), "paged_ms": _best_ms(paged, reps),
            "flash_ms": _best_ms(flash, reps), "max_abs_difference": (reference - paged()).abs().max().item(),
            "flash_max_abs_difference": (reference - flash()).abs().max().item()}


def fresh_prompt(ops, C: int, reps: int) -> dict:
    """A prompt with nothing cached: causal SDPA over its own K/V (the torch backend's path)
    against the flash-style kernel reading the same K/V from the block pool."""
    nb = -(-C // BS)
    k_cache = torch.randn(nb + 4, HKV, BS, D)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(nb + 4)[:nb]
    k = k_cache[table].transpose(1, 2).flatten(0, 1)[:C]  # [C, Hkv, D]
    v = v_cache[table].transpose(1, 2).flatten(0, 1)[:C]
    q = torch.randn(C, HQ, D)

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                              v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=D**-0.5,
                                              enable_gqa=True)

    def flash():
        return ops.paged_prefill_attention(q, k_cache, v_cache, table, 0, D**-0.5, 0)

    err = (sdpa().squeeze(0).transpose(0, 1) - flash()).abs().max().item()
    return {"chunk": C, "causal_sdpa_ms": _best_ms(sdpa, reps), "flash_ms": _best_ms(flash, reps),
            "max_abs_difference": err}


def shared_prefix_decode(ops, P: int, batch: int, own: int, reps: int) -> dict:
    prefix_blocks, own_blocks = P // BS, -(-own // BS)
    nb = prefix_blocks * (batch + 1) + own_blocks * batch
    k_cache = torch.randn(nb, HKV, BS, D)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(nb)
    shared = order[:prefix_blocks]
    copies = order[prefix_blocks: prefix_blocks * (batch + 1)].view(batch, prefix_blocks)
    mine = order[prefix_blocks * (batch + 1):].view(batch, own_blocks)
    for c in copies:
        k_cache[c], v_cache[c] = k_cache[shared], v_cache[shared]
    shared_tables = torch.cat([shared.expand(batch, -1), mine], dim=1)
    private_tables = torch.cat([copies, mine], dim=1)
    lens = torch.tensor([P + own - i % 7 for i in range(batch)])
    q = torch.randn(batch, HQ, D)
    run = lambda tables: ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5, 0)  # noqa: E731
    return {"prefix": P, "batch": batch, "own_tokens": own, "shared_blocks_ms": _best_ms(lambda: run(shared_tables), reps),
            "private_blocks_ms": _best_ms(lambda: run(private_tables), reps),
            "same_bits": bool(torch.equal(run(shared_tables), run(private_tables)))}


def kernel_mode(args) -> dict:
    from pagoda.layers.cpu_kernels import load_cpu_kernels

    ops = load_cpu_kernels()
    torch.set_num_threads(args.threads)
    prefill = [prefill_over_prefix(ops, P, C, args.reps) for P in (512, 2048, 8192) for C in (32, 128, 512, 1024, 2048)]
    for r in prefill:
        print(f"prefix {r['prefix']:5d} chunk {r['chunk']:5d}: gathered+SDPA {r['gathered_sdpa_ms']:8.2f} ms  "
              f"paged {r['paged_ms']:8.2f} ms  ({r['gathered_sdpa_ms'] / r['paged_ms']:.2f}x)  "
              f"flash {r['flash_ms']:8.2f} ms  ({r['gathered_sdpa_ms'] / r['flash_ms']:.2f}x)", flush=True)
    fresh = [fresh_prompt(ops, C, args.reps) for C in (512, 1024, 2048, 4096, 8192)]
    for r in fresh:
        print(f"fresh prompt {r['chunk']:5d}: causal SDPA {r['causal_sdpa_ms']:8.2f} ms  flash {r['flash_ms']:8.2f} ms  "
              f"({r['causal_sdpa_ms'] / r['flash_ms']:.2f}x)", flush=True)
    shared = [shared_prefix_decode(ops, P, 64, 32, args.reps) for P in (512, 1024, 2048, 4096)]
    for r in shared:
        print(f"64 decode rows, shared prefix {r['prefix']:5d}: shared blocks {r['shared_blocks_ms']:7.2f} ms  "
              f"private copies {r['private_blocks_ms']:7.2f} ms  ({r['private_blocks_ms'] / r['shared_blocks_ms']:.2f}x, "
              f"same bits: {r['same_bits']})", flush=True)
    return {"prefill_over_prefix": prefill, "fresh_prompt": fresh, "shared_prefix_decode": shared}


# -- the engine ---------------------------------------------------------------------------------

def _run_requests(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[float]]:
    """All prompts at once; returns each request's TTFT and the durations of the steps in which
    every request was decoding."""
    from pagoda import SamplingParams
    from pagoda.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": ids}, params)
    first: dict[str, float] = {}
    steps, done, last = [], 0, None
    while done < len(prompts):
        outs = engine.step()
        now = time.perf_counter()
        if len(first) == len(prompts) and last is not None and not any(o.finished for o in outs):
            steps.append(now - last)
        for o in outs:
            first.setdefault(o.request_id, now - start)
            done += o.finished
        last = now
    return list(first.values()), steps


def engine_mode(args) -> dict:
    from pagoda import LLM

    llm = LLM(model=args.model, quantization=args.quantization, kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=False)
    engine = llm.engine
    vocab = engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else 32000
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(100, min(vocab, 30000), (n,), generator=g).tolist()  # noqa: E731
    _run_requests(engine, [prompt(64)], 4)  # warm-up
    out = {"decode_vs_context": [], "decode_vs_batch": [], "prefill_vs_context": []}
    for L in args.contexts:
        ttfts, steps = _run_requests(engine, [prompt(L)], args.decode_steps + 1)
        out["prefill_vs_context"].append({"context": L, "prefill_s": ttfts[0]})
        out["decode_vs_context"].append({"context": L, "itl_ms": statistics.median(steps) * 1e3})
        print(f"context {L:5d}: prefill {ttfts[0]:.3f} s, decode ITL {statistics.median(steps) * 1e3:.2f} ms", flush=True)
    budget = engine.config.scheduler.max_num_batched_tokens
    for B in args.batches:
        # enough tokens that the first requests still decode when the last one's prefill ends
        prefill_steps = -(-B * args.batch_context // budget)
        _, steps = _run_requests(engine, [prompt(args.batch_context) for _ in range(B)],
                                 args.decode_steps + 1 + prefill_steps)
        itl = statistics.median(steps)
        out["decode_vs_batch"].append({"batch": B, "context": args.batch_context, "itl_ms": itl * 1e3, "tok_s": B / itl})
        print(f"batch {B:3d} at context {args.batch_context}: ITL {itl * 1e3:.2f} ms, {B / itl:.1f} tok/s", flush=True)
    return out


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|")


def llama_batched_bench(binary: str, gguf: str, npp: list[int], npl: list[int], ntg: int, threads: int,
                        extra: list[str]) -> list[dict]:
    """llama.cpp's own sweep; each row: prompt tokens, decode tokens, parallel sequences, prefill
    time and decode time (all sequences' ntg steps)."""
    ctx = max(npl) * (max(npp) + ntg) + 64
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-t", str(threads), "-ngl", "0",
           "-npp", ",".join(map(str, npp)), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), *extra]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if m:
            pp, tg, b, _, t_pp, _, t_tg, _ = m.groups()
            rows.append({"prompt": int(pp), "decode_tokens": int(tg), "batch": int(b), "prefill_s": float(t_pp),
                         "itl_ms": float(t_tg) / int(tg) * 1e3})
    return rows


def llama_mode(args) -> dict:
    from pagoda.bench import baselines

    gguf = args.gguf or str(baselines.gguf_file(args.model))
    extra = args.llama_args.split()
    by_context = llama_batched_bench(args.llama_batched_bench, gguf, args.contexts, [1], args.decode_steps, args.threads,
                                     extra)
    by_batch = llama_batched_bench(args.llama_batched_bench, gguf, [args.batch_context], args.batches, args.decode_steps,
                                   args.threads, extra)
    return {"gguf": gguf, "extra_args": extra,
            "decode_vs_context": [{"context": r["prompt"], "itl_ms": r["itl_ms"]} for r in by_context],
            "prefill_vs_context": [{"context": r["prompt"], "prefill_s": r["prefill_s"]} for r in by_context],
            "decode_vs_batch": [{"batch": r["batch"], "context": r["prompt"], "itl_ms": r["itl_ms"],
                                 "tok_s": r["batch"] / r["itl_ms"] * 1e3} for r in by_batch]}


def plot(systems: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("decode_vs_context", "context", "itl_ms", "decode ITL at batch 1 (ms)", "context (tokens)"),
              ("prefill_vs_context", "context", "prefill_s", "prefill time of one prompt (s)", "prompt (tokens)"),
              ("decode_vs_batch", "batch", "tok_s", "decode tok/s at context 512", "batch (sequences)")]
    for ax, (key, x, y, title, xlabel) in zip(axes, panels):
        for name, res in systems.items():
            pts = res.get(key, [])
            ax.plot([p[x] for p in pts], [p[y] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["kernel", "engine"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--kv-cache-memory", type=float, default=4.0)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--batch-context", type=int, default=512)
    ap.add_argument("--contexts", default="512,1024,2048,4096,8000",
                    help="the context sweep, at batch 1 (prompt tokens; with the decode steps within the model's context)")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128", help="the batch sweep, at --batch-context")
    ap.add_argument("--llama-batched-bench", default=None, help="path of llama.cpp's llama-batched-bench")
    ap.add_argument("--gguf", default=None, help="the GGUF file for llama.cpp (default: the model's)")
    ap.add_argument("--llama-args", default="", help="more llama-batched-bench arguments, e.g. --no-repack "
                    "(where the CPU reports AMX but the kernel does not grant it, llama.cpp's AMX path faults)")
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]

    from pagoda.platform import benchmark_cpu_flags, cpu_model

    record = {"date": date.today().isoformat(), "command": " ".join(sys.argv), "cpu": cpu_model(),
              "cpu_flags": benchmark_cpu_flags(), "threads": args.threads, "loadavg_before": os.getloadavg()}
    if args.mode == "kernel":
        record["results"] = kernel_mode(args)
        name = "attention-kernel"
    else:
        systems = {f"pagoda {args.quantization or 'fp32'}": engine_mode(args)}
        if args.llama_batched_bench:
            systems["llama.cpp"] = llama_mode(args)
        record["systems"] = systems
        name = "attention-scaling"
        png = RESULTS / "plots" / f"{name}-{record['date']}.png"
        png.parent.mkdir(parents=True, exist_ok=True)
        plot(systems, png)
        print(f"plot: {png}")
    record["loadavg_after"] = os.getloadavg()
    path = Path(args.save) if args.save else RESULTS / f"{name}-{record['date']}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
