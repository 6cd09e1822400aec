"""Time from a fresh interpreter to a model's first token: what every `pagoda serve`, engine
process, tensor-parallel rank and replica pays when it starts.

    python benchmarks/startup_time.py --models /path/to/hf-dir,smollm2-135m-instruct --rounds 3 \
        --save benchmarks/results/startup-time-<date>.json

Each round runs one child process per model: it imports what `pagoda serve` imports
(``pagoda.entrypoints.openai.api_server``), builds an ``LLM`` (the model, the KV cache at its
default 2 GiB budget) and generates one token. The child reports the wall time of the two
phases, its CPU seconds and its peak resident memory, and whether ``torch._dynamo`` got imported.
The kernels must already be built (a first start compiles them: see "Kernel build time").
To compare two trees, run the script once per tree (``PYTHONPATH=<other checkout>``, with its own
``PAGODA_HOME``); the child runs with ``-P``, so a checkout in the working directory does not
shadow it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
t0 = time.time()
import pagoda.entrypoints.openai.api_server  # what `pagoda serve` imports
from pagoda import LLM, SamplingParams
t1 = time.time()
model = sys.argv[1]
llm = LLM(model, **({"quantization": "gguf"} if model.endswith(".gguf") else {}))
llm.generate(["hi"], SamplingParams(max_tokens=1), use_tqdm=False)
t2 = time.time()
r = resource.getrusage(resource.RUSAGE_SELF)
print("STARTUP " + json.dumps({"imports_s": t1 - t0, "engine_s": t2 - t1, "total_s": t2 - t0,
                               "cpu_s": r.ru_utime + r.ru_stime, "max_rss_mib": r.ru_maxrss / 1024,
                               "dynamo_imported": "torch._dynamo" in sys.modules,
                               "pagoda": pagoda.__file__}))
"""


def measure(model: str) -> dict:
    proc = subprocess.run([sys.executable, "-P", "-c", CHILD, model], capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("STARTUP ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{model}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("STARTUP "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m-instruct", help="comma-separated model names or paths")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--save", type=Path, default=None)
    args = p.parse_args()
    models = [m for m in args.models.split(",") if m]
    runs: dict[str, list[dict]] = {m: [] for m in models}
    for i in range(args.rounds):
        for model in models:
            r = measure(model)
            runs[model].append(r)
            print(f"round {i + 1} {model}: imports {r['imports_s']:.2f} s + engine {r['engine_s']:.2f} s = "
                  f"{r['total_s']:.2f} s, cpu {r['cpu_s']:.2f} s, max rss {r['max_rss_mib']:.0f} MiB, "
                  f"torch._dynamo imported: {r['dynamo_imported']}", flush=True)
    summary = {m: {k: statistics.median(r[k] for r in rs) for k in ("imports_s", "engine_s", "total_s", "cpu_s",
                                                                    "max_rss_mib")} for m, rs in runs.items()}
    for model, s in summary.items():
        print(f"median {model}: {s['total_s']:.2f} s to the first token, cpu {s['cpu_s']:.2f} s, "
              f"max rss {s['max_rss_mib']:.0f} MiB")
    if args.save:
        from pagoda.platform import cpu_flags

        args.save.write_text(json.dumps({"cpu": platform.processor() or platform.machine(),
                                         "cpu_flags": sorted(cpu_flags()), "runs": runs, "median": summary},
                                        indent=1))


if __name__ == "__main__":
    main()
