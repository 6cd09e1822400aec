"""What each piece of the CPU fast path buys: decode step time at batch 1 and 64, one run.

    python benchmarks/decode_step.py                 # writes results/decode-step-<date>.json

Every configuration runs in its own process (the kernel switch is read once per process), one
after another, on SmolLM2-135M-Instruct with 32-token prompts, greedy, `ignore_eos`; the step
times are medians after the prefill, and the forward (the model call without the head and
sampling) is timed separately. Configurations:

- torch: PAGODA_DISABLE_KERNELS=1, every layer in plain torch (quantized layers on torch's
  int8/int4 kernels), as on a machine without a compiler;
- kernels, python layers: the C++ kernels (attention, block matmul, fused ops), the decoder
  layers still called from Python;
- kernels + stack: decode-only steps run the whole decoder stack in one C++ call (the default);
- weights not packed: PAGODA_PACK_WEIGHTS=0, block weights not packed at load for the GEMM from 16
  rows (layers/packed_weights.py), so each call dequantizes them.
"fp32" rows pass dtype=float32 (``--dtype auto`` may choose bf16 on some CPUs).
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

HERE = Path(__file__).parent
CONFIGS = [  # (label, quantization, environment, decode stack on)
    ("torch", None, {"PAGODA_DISABLE_KERNELS": "1"}, False),
    ("torch", "gguf", {"PAGODA_DISABLE_KERNELS": "1"}, False),
    ("kernels, python layers", None, {}, False),
    ("kernels, python layers", "gguf", {}, False),
    ("kernels + stack", None, {}, True),
    ("kernels + stack", "gguf", {}, True),
    ("kernels + stack", "int8", {}, True),
    ("kernels + stack", "int4", {}, True),
    ("kernels + stack, weights not packed", "gguf", {"PAGODA_PACK_WEIGHTS": "0"}, True),
    ("kernels + stack, weights not packed", "int8", {"PAGODA_PACK_WEIGHTS": "0"}, True),
]


def measure(quantization: str | None, stack: bool, batches: list[int], steps: int, threads: int) -> dict:
    import torch

    from pagoda import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model="smollm2-135m-instruct", kv_cache_memory=1.0, quantization=quantization, dtype="float32",
              fused_decode=stack)
    engine, runner = llm.engine, llm.engine.core.runner
    forward, forward_times = runner.forward, []

    def timed_forward(*args):
        start = time.perf_counter()
        out = forward(*args)
        forward_times.append(time.perf_counter() - start)
        return out

    runner.forward = timed_forward
    result = {}
    for batch in batches:
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", {"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(32)]},
                               SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
        engine.step()  # the prefill
        step_times = []
        forward_times.clear()
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
        result[batch] = {"step_ms": 1e3 * statistics.median(step_times[1:]),
                         "forward_ms": 1e3 * statistics.median(forward_times[1:])}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default=None, help="a regular expression: run the configurations whose "
                   "'label weights' it matches (e.g. 'stack.*gguf')")
    p.add_argument("--save", default=None, help="JSON path (default: results/decode-step-<date>.json)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one configuration
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.one is not None:
        quantization, stack = json.loads(args.one)
        print(json.dumps(measure(quantization, stack, batches, args.steps, args.threads)))
        return 0
    rows = []
    for label, quantization, env, stack in CONFIGS:
        if args.only and not re.search(args.only, f"{label} {quantization or 'fp32'}"):
            continue
        out = subprocess.run([sys.executable, __file__, "--batches", args.batches, "--steps", str(args.steps),
                              "--threads", str(args.threads), "--one", json.dumps([quantization, stack])],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        row = {"config": label, "weights": quantization or "fp32", **{f"b{b}": result[str(b)] for b in batches}}
        rows.append(row)
        print(" | ".join([label, row["weights"]] + [f"b={b}: step {result[str(b)]['step_ms']:.1f} ms, forward "
                                                    f"{result[str(b)]['forward_ms']:.1f} ms" for b in batches]),
              flush=True)
    path = Path(args.save) if args.save else HERE / "results" / f"decode-step-{date.today().isoformat()}.json"
    path.write_text(json.dumps({"date": date.today().isoformat(), "command": " ".join(sys.argv), "threads": args.threads,
                                "steps": args.steps, "rows": rows, "loadavg": os.getloadavg()}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
