"""`pagoda quantize`'s methods compared on SmolLM2-135M-Instruct: rtn vs awq vs gptq, 4 and 8 bits.

    python benchmarks/quantize_methods.py --num-samples 128    # writes results/quantize-methods-<date>.json

1. One process loads the model in fp32 (the catalog's Q4_1 GGUF, dequantized), draws the
   calibration samples (the default set, `--num-samples` of them) and writes one GGUF per
   method and block type with pagoda/quantize (the same code as `pagoda quantize`), timing each:
   "calibration s" is the time awq / gptq spend running the samples through the layers one at
   a time (each method does its own run, since each layer's inputs come from the layers before
   it as that method quantized them), "quantize s" the method's own work.
2. Each GGUF, and the fp32 model as the reference, is then scored by benchmarks/quality.py's
   measurements, each in its own process: perplexity of data/perplexity.txt (held-out: the
   calibration set shares no text with it) and greedy agreement with fp32. The GGUFs run in
   pagoda's fast path (`--quantization gguf`: int8 activations, as llama.cpp); fp32 is the
   reference, so a method's "Δ ppl" includes the int8 activations as well as its weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import quality


def quantize_all(args: argparse.Namespace) -> list[dict]:
    """Calibrate once, write every (method, block type); timings and output errors per file."""
    import torch

    from pagoda.quantize.quantizer import calibrate, load_float_model, write_quantized

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    start = time.perf_counter()
    llm = load_float_model(args.model)
    load_s = time.perf_counter() - start
    samples = calibrate(llm, None, args.num_samples, args.max_sample_tokens)
    print(f"[quantize] calibration: {len(samples)} samples, {sum(map(len, samples))} tokens",
          file=sys.stderr, flush=True)
    rows = []
    for qtype in args.qtypes.split(","):
        for method in args.methods.split(","):
            path = out_dir / f"smollm2-{method}-{qtype.lower()}.gguf"
            r = write_quantized(llm, path, method, qtype, samples if method != "rtn" else None)
            print(f"[quantize] {method} {qtype}: layers {r.calibration_s:.1f} s, method {r.quantize_s:.1f} s, "
                  f"output error {r.relative_error}", file=sys.stderr, flush=True)
            rows.append({"name": f"{method}-{qtype}", "method": method, "qtype": qtype, "path": str(path),
                         "quantize_s": round(r.quantize_s, 1), "write_s": round(r.write_s, 1),
                         "calibration_s": round(r.calibration_s, 1),
                         "relative_output_error": r.relative_error, "rtn_relative_output_error": r.rtn_relative_error,
                         "file_mib": path.stat().st_size / 2**20})
    llm.shutdown()
    for row in rows:
        row.update(samples=len(samples), tokens=sum(map(len, samples)), load_s=round(load_s, 1))
    return rows


def existing_files(args: argparse.Namespace) -> list[dict]:
    """Rows for GGUFs an earlier run left in --out-dir (--reuse-files: score them again without
    quantizing; the quantization times are then unknown here)."""
    rows = []
    for qtype in args.qtypes.split(","):
        for method in args.methods.split(","):
            path = Path(args.out_dir) / f"smollm2-{method}-{qtype.lower()}.gguf"
            if not path.is_file():
                raise ValueError(f"--reuse-files: {path} does not exist")
            rows.append({"name": f"{method}-{qtype}", "method": method, "qtype": qtype, "path": str(path),
                         "quantize_s": None, "write_s": None, "calibration_s": None, "relative_output_error": None,
                         "rtn_relative_output_error": None, "file_mib": path.stat().st_size / 2**20})
    return rows


def _quality_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(model=args.model, threads=args.threads, kv_cache_memory=0.5, num_prompts=args.num_prompts,
                              prompt_len=32, greedy_tokens=args.greedy_tokens)


def evaluate(name: str, model: str | None, args: argparse.Namespace) -> dict:
    """quality.run_mode for the fp32 reference (model None) or a GGUF in the fast path, in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--eval", name, "--eval-model", model or "", "--run-output", str(out),
               "--model", args.model, "--threads", str(args.threads), "--num-prompts", str(args.num_prompts),
               "--greedy-tokens", str(args.greedy_tokens)]
        subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        return json.loads(out.read_text())


def _run_eval(args: argparse.Namespace) -> None:
    spec = {"dtype": "float32"} if not args.eval_model else {"dtype": "float32", "quantization": "gguf",
                                                              "model": args.eval_model}
    quality.MODES[args.eval] = spec
    Path(args.run_output).write_text(json.dumps(quality.run_mode(args.eval, _quality_args(args))))


def _table(ref: dict, rows: list[dict]) -> str:
    lines = [("| method | blocks | calibration s | quantize s | output error (rtn's) | perplexity | Δ ppl "
              "| mean abs Δ logprob | greedy agreement | before first difference |"),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
             f"| fp32 | - | - | - | - | {ref['perplexity']:.3f} | - | - | - | - |"]
    for r in rows:
        q = r["quality"]
        err = "-" if r["relative_output_error"] is None else \
            f"{100 * r['relative_output_error']:.2f} % ({100 * r['rtn_relative_output_error']:.2f} %)"
        secs = lambda v: "?" if v is None else f"{v:.0f}"
        lines.append(f"| {r['method']} | {r['qtype']} | {secs(r['calibration_s'])} | {secs(r['quantize_s'])} | {err} "
                     f"| {q['perplexity']:.3f} | {q['perplexity_change_pct']:+.2f} % | {q['mean_abs_logprob_diff']:.4f} "
                     f"| {100 * q['greedy_agreement']:.1f} % | {100 * q['greedy_prefix_agreement']:.1f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--methods", default="rtn,awq,gptq")
    p.add_argument("--qtypes", default="Q4_0,Q8_0")
    p.add_argument("--num-samples", type=int, default=512)
    p.add_argument("--max-sample-tokens", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=16, help="greedy-agreement prompts")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "pagoda-quantize-bench"))
    p.add_argument("--output", default=str(HERE / "results" / f"quantize-methods-{date.today().isoformat()}.json"))
    p.add_argument("--reuse-files", action="store_true",
                   help="score the GGUFs an earlier run wrote to --out-dir instead of quantizing again")
    p.add_argument("--eval", default=None, help=argparse.SUPPRESS)  # internal: score one model, in this process
    p.add_argument("--eval-model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-output", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.eval:
        _run_eval(args)
        return 0
    rows = quantize_all(args) if not args.reuse_files else existing_files(args)
    print("[quality] fp32 ...", file=sys.stderr, flush=True)
    ref = evaluate("fp32", None, args)
    for row in rows:
        print(f"[quality] {row['name']} ...", file=sys.stderr, flush=True)
        res = evaluate(row["name"], row["path"], args)
        quality.compare(ref, res)
        row["quality"] = {k: v for k, v in res.items() if k not in ("token_logprobs", "greedy_tokens")}
    summary = {"date": date.today().isoformat(),
               "command": "python benchmarks/quantize_methods.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "model": args.model, "text": "benchmarks/data/perplexity.txt", "threads": args.threads,
               "reference": {k: v for k, v in ref.items() if k not in ("token_logprobs", "greedy_tokens")},
               "results": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print(_table(ref, rows))
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
