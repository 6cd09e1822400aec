"""Speed, memory and quality of each weight mode, on SmolLM2-135M-Instruct (the catalog's Q4_1 GGUF).

    python benchmarks/quality.py                          # every mode; writes results/quality-<date>.json
    python benchmarks/quality.py --modes fp32,int8,gguf   # a subset (fp32 is always run: the reference)
    python benchmarks/quality.py --kernels                # one layer per SmolLM2 shape and mode, M = 1 and 64

Modes: fp32 and bf16 (GGUF dequantized, ``--dtype``), int8 and int4 (``--quantization``: Q8_0 and
Q4_1 blocks from the dequantized weights, the head tied to the embedding in Q8_0), gguf
(``--quantization gguf``: the file's Q4_1 projections and Q8_0 embedding/head as stored), and
int8-floathead / int4-floathead (the same with the head left in fp32).
Memory and quality are measured with each mode in its own process, so its memory is its own:

- weight MiB: bytes of the model's parameters and buffers; RSS after load and peak RSS;
- perplexity of ``data/perplexity.txt`` (prompt logprobs, one request), and the mean absolute
  difference of its per-token logprobs from fp32's;
- greedy agreement with fp32: N prompts (windows of the same text) × M greedy tokens; the share of
  positions whose token equals fp32's, and the mean share of each output before its first
  difference;
- decode tokens/s at batch 1 and at batch 64 (32-token prompts, timed after the prefill step), with
  every mode loaded in one process and measured in turns, ``--repeats`` rounds; the best run of
  each is reported (the machine is shared: the best run is the least disturbed one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
TEXT = HERE / "data" / "perplexity.txt"

MODES: dict[str, dict] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    # batch-invariant: a prefill's many rows on the integer kernels, not the bf16 route (AMX-BF16)
    "gguf-deterministic": {"dtype": "float32", "quantization": "gguf", "deterministic": True},
    # --kv-cache-dtype: the prompt in chunks of 64 tokens, so the perplexity reads the cache too
    # (one whole prefill attends over its fresh fp32 K/V); fp32-chunked shows chunking alone
    "fp32-chunked": {"dtype": "float32", "max_num_batched_tokens": 64},
    "kv-bf16": {"dtype": "float32", "kv_cache_dtype": "bfloat16", "max_num_batched_tokens": 64},
    "kv-fp16": {"dtype": "float32", "kv_cache_dtype": "float16", "max_num_batched_tokens": 64},
    "kv-int8": {"dtype": "float32", "kv_cache_dtype": "int8", "max_num_batched_tokens": 64},
    "kv-fp8": {"dtype": "float32", "kv_cache_dtype": "fp8", "max_num_batched_tokens": 64},
    "kv-fp8-e5m2": {"dtype": "float32", "kv_cache_dtype": "fp8_e5m2", "max_num_batched_tokens": 64},
    "int8-floathead": {"dtype": "float32", "quantization": "int8", "head": False},
    "int4-floathead": {"dtype": "float32", "quantization": "int4", "head": False},
}


# SmolLM2-135M's projections (out x in): merged qkv, o, merged gate/up, down; and the tied head.
KERNEL_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def _best_ms(f, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``f()``, in ms (after one warm-up call)."""
    import torch

    from pagoda.layers.cpu_timing import best_ms

    with torch.inference_mode():
        return round(best_ms(f, trials=repeats), 3)


def _layers(w, modes: list[str]) -> dict:
    """One layer per mode on weight ``w``: ``F.linear`` in fp32 or bf16, or pagoda's quantized
    layers (bf16 activations, or fp32 ones: the kernels' slow exact path)."""
    import torch
    import torch.nn.functional as F

    from pagoda.layers import ggml_blocks
    from pagoda.layers.ggml_blocks import BlockLinear
    from pagoda.layers.torch_int_linears import Int4Linear, Int8Linear

    wb = w.bfloat16()
    makers = {
        "fp32": lambda: (lambda x: F.linear(x, w)),
        "bf16": lambda: (lambda x: F.linear(x.bfloat16(), wb).float()),
        "Q8_0": lambda: BlockLinear.from_float(w, ggml_blocks.Q8_0),
        "Q4_1": lambda: BlockLinear.from_float(w, ggml_blocks.Q4_1),
        "int8": lambda: Int8Linear.from_float(w),
        "int4": lambda: Int4Linear.from_float(w),
        "int8 fp32-act": lambda: Int8Linear.from_float(w, compute_dtype=torch.float32),
        "int4 fp32-act": lambda: Int4Linear.from_float(w, compute_dtype=torch.float32),
    }
    return {mode: makers[mode]() for mode in modes}


# Q8_0 / Q4_1: pagoda's block kernel (int8 activations); int8 / int4: torch's kernels (the fallback).
KERNEL_MODES = ["fp32", "bf16", "Q8_0", "Q4_1", "int8", "int4", "int8 fp32-act", "int4 fp32-act"]


def kernel_table(threads: int, repeats: int = 20) -> list[dict]:
    """ms per call of one layer per mode at M = 1 and 64 (best of ``repeats``; weights hot in cache)."""
    import torch

    torch.set_num_threads(threads)
    rows = []
    for name, (n, k) in KERNEL_SHAPES.items():
        layers = _layers(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05, KERNEL_MODES)
        for m in (1, 64):
            x = torch.randn(m, k)
            row = {"layer": name, "shape": [n, k], "M": m}
            for mode, f in layers.items():
                if "fp32-act" in mode and (m > 1 or n > 3072):
                    continue  # 10-60x slower than fp32: measured once at M=1 to show it
                row[mode] = _best_ms(lambda f=f, x=x: f(x), repeats)
            rows.append(row)
    rows += _model_rows(repeats=5)
    return rows


def _model_rows(repeats: int, num_layers: int = 30) -> list[dict]:
    """All of SmolLM2's projections (30 layers x qkv, o, gate/up, down, distinct weights, so they
    stream from memory as in a decode step), run one after another; ms per pass."""
    import torch

    g = torch.Generator().manual_seed(0)
    names = ["qkv", "o", "gate_up", "down"] * num_layers
    per_layer = [_layers(torch.randn(*KERNEL_SHAPES[name], generator=g) * 0.05, KERNEL_MODES[:6]) for name in names]
    widths = [KERNEL_SHAPES[name][1] for name in names]
    rows = []
    for m in (1, 64):
        inputs = {width: torch.randn(m, width) for width in set(widths)}
        row = {"layer": f"all {num_layers} layers", "shape": [0, 0], "M": m}
        for mode in KERNEL_MODES[:6]:
            def one_pass(mode=mode, inputs=inputs):
                for layers, width in zip(per_layer, widths):
                    layers[mode](inputs[width])
            row[mode] = _best_ms(one_pass, repeats)
        rows.append(row)
    return rows


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _decode_tok_s(llm, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens/s of the decode steps (the first step, which prefills every prompt, is not timed)."""
    from pagoda.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"decode-{len(prompts)}-{i}", {"prompt_token_ids": ids}, params)
    engine.step()  # prefill (all prompts fit one step's token budget) + each request's first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * (max_tokens - 1) / (time.perf_counter() - start)


def _load(mode: str, args: argparse.Namespace):
    import torch

    from pagoda import LLM
    from pagoda.layers import quantization

    torch.set_num_threads(args.threads)
    spec = dict(MODES[mode])
    quantization.QUANTIZE_LM_HEAD = spec.pop("head", None)
    model = spec.pop("model", args.model)  # a mode may bring its own file (benchmarks/quantize_methods.py)
    llm = LLM(model=model, kv_cache_memory=args.kv_cache_memory, **spec)
    quantization.QUANTIZE_LM_HEAD = None
    return llm, spec


def run_speed(modes: list[str], args: argparse.Namespace) -> dict:
    """Decode tokens/s of every mode, loaded side by side in this process and measured in turns
    (``--repeats`` rounds of all modes), so a busy spell of the shared machine hits them alike."""
    llms = {mode: _load(mode, args)[0] for mode in modes}
    text_ids = llms[modes[0]].get_tokenizer().encode(TEXT.read_text(), add_special_tokens=False)
    runs: dict[str, dict[str, list[float]]] = {m: {str(b): [] for b in args.batch_sizes} for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            for batch in args.batch_sizes:
                prompts = [text_ids[(i * 7) % (len(text_ids) - 32) :][:32] for i in range(batch)]
                runs[mode][str(batch)].append(_decode_tok_s(llms[mode], prompts, args.decode_tokens))
    return runs


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    """Memory and quality of one mode, in this process."""
    import torch

    from pagoda.layers import quantization
    from pagoda.sampling_params import SamplingParams

    rss_before = _rss_mib()
    start = time.perf_counter()
    llm, spec = _load(mode, args)
    load_s = time.perf_counter() - start
    model = llm.engine.core.model
    result = {
        "mode": mode, "engine_args": spec, "quantize_lm_head": MODES[mode].get("head"),
        "load_s": round(load_s, 2), "weight_mib": quantization.weight_bytes(model) / 2**20,
        "rss_before_load_mib": rss_before, "rss_after_load_mib": _rss_mib(),
        "peak_rss_load_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "torch_threads": torch.get_num_threads(),
    }

    tokenizer = llm.get_tokenizer()
    text_ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": text_ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [pos[tok].logprob for tok, pos in zip(text_ids[1:], out[0].prompt_logprobs[1:])]
    result["text_tokens"] = len(text_ids)
    result["perplexity"] = math.exp(-sum(logprobs) / len(logprobs))
    result["token_logprobs"] = logprobs

    stride = max(1, (len(text_ids) - args.prompt_len) // args.num_prompts)
    windows = [text_ids[i * stride : i * stride + args.prompt_len] for i in range(args.num_prompts)]
    greedy = llm.generate([{"prompt_token_ids": w} for w in windows],
                          SamplingParams(max_tokens=args.greedy_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    result["greedy_tokens"] = [list(o.outputs[0].token_ids) for o in greedy]

    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def compare(ref: dict, res: dict) -> None:
    """Add the comparisons with the fp32 reference to ``res``."""
    diffs = [abs(a - b) for a, b in zip(ref["token_logprobs"], res["token_logprobs"])]
    res["mean_abs_logprob_diff"] = sum(diffs) / len(diffs)
    res["perplexity_change_pct"] = 100.0 * (res["perplexity"] / ref["perplexity"] - 1.0)
    same = total = 0
    prefix_shares = []
    for a, b in zip(ref["greedy_tokens"], res["greedy_tokens"]):
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix_shares.append(prefix / len(a))
    res["greedy_agreement"] = same / total
    res["greedy_prefix_agreement"] = sum(prefix_shares) / len(prefix_shares)


def _table(results: list[dict]) -> str:
    rows = [("| mode | weight MiB | RSS after load MiB | peak RSS while loading MiB | perplexity | Δ ppl "
             "| mean abs Δ logprob | greedy agreement | agreement before first difference | decode tok/s b=1 "
             "| decode tok/s b=64 |"),
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        tps = r["decode_tok_s"]
        rows.append(f"| {r['mode']} | {r['weight_mib']:.0f} | {r['rss_after_load_mib']:.0f} | {r['peak_rss_load_mib']:.0f} "
                    f"| {r['perplexity']:.3f} | {r.get('perplexity_change_pct', 0.0):+.2f} % "
                    f"| {r.get('mean_abs_logprob_diff', 0.0):.4f} | {100 * r.get('greedy_agreement', 1.0):.1f} % "
                    f"| {100 * r.get('greedy_prefix_agreement', 1.0):.1f} % | "
                    + " | ".join(f"{tps.get(str(b), float('nan')):.1f}" for b in (1, 64)) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--num-prompts", type=int, default=16, help="greedy-agreement prompts")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="rounds of decode runs over all modes; the best is reported")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine, 2 OpenMP threads stall whenever "
                        "another process takes a core, which swamps the differences between modes)")
    p.add_argument("--kernels", action="store_true", help="only time one layer per mode and shape (no model)")
    p.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB, the same for every mode")
    p.add_argument("--output", default=str(HERE / "results" / f"quality-{date.today().isoformat()}.json"))
    p.add_argument("--run-mode", default=None, help=argparse.SUPPRESS)  # internal: one mode, in this process
    p.add_argument("--run-output", default=None, help=argparse.SUPPRESS)
    p.add_argument("--speed", action="store_true", help=argparse.SUPPRESS)  # internal: with --run-mode
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    if args.kernels:
        rows = kernel_table(args.threads)
        modes = [k for k in rows[0] if k not in ("layer", "shape", "M")]
        print("| layer | N x K | M | " + " | ".join(f"{m} ms" for m in modes) + " |")
        print("| --- | --- | ---: | " + " | ".join("---:" for _ in modes) + " |")
        for r in rows:
            shape = f"{r['shape'][0]} x {r['shape'][1]}" if r["shape"][0] else "-"
            print(f"| {r['layer']} | {shape} | {r['M']} | "
                  + " | ".join(f"{r[m]:.3f}" if m in r else "-" for m in modes) + " |")
        out = Path(args.output).with_name(Path(args.output).stem + "-kernels.json")
        out.write_text(json.dumps({"date": date.today().isoformat(), "threads": args.threads, "rows": rows}, indent=2) + "\n")
        print(f"\nwritten to {out}")
        return 0

    if args.run_mode:
        result = run_speed(args.run_mode.split(","), args) if args.speed else run_mode(args.run_mode, args)
        Path(args.run_output).write_text(json.dumps(result))
        return 0

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    if "fp32" not in modes:
        modes.insert(0, "fp32")
    modes.sort(key=lambda m: m != "fp32")
    results = []
    own_args = argv if argv is not None else sys.argv[1:]

    def child(run_mode: str, *extra: str) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, *own_args, "--run-mode", run_mode, "--run-output", str(out), *extra]
            subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            return json.loads(out.read_text())

    for mode in modes:  # memory and quality: one process per mode, so its memory is its own
        print(f"[quality] {mode} ...", file=sys.stderr, flush=True)
        results.append(child(mode))
    print("[quality] decode speed, all modes in turns ...", file=sys.stderr, flush=True)
    speed = child(",".join(modes), "--speed")
    for res in results:
        res["decode_tok_s_runs"] = speed[res["mode"]]
        res["decode_tok_s"] = {b: max(runs) for b, runs in speed[res["mode"]].items()}
    for res in results[1:]:
        compare(results[0], res)
    summary = {
        "date": date.today().isoformat(),
        "command": "python benchmarks/quality.py " + " ".join(own_args),
        "model": args.model, "text": str(TEXT.relative_to(HERE.parent)), "text_tokens": results[0]["text_tokens"],
        "greedy": {"prompts": args.num_prompts, "prompt_len": args.prompt_len, "tokens": args.greedy_tokens},
        "decode_tokens": args.decode_tokens, "threads": args.threads,
        "results": [{k: v for k, v in r.items() if k not in ("token_logprobs", "greedy_tokens")} for r in results],
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print(_table(results))
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
