"""Model switch time: one `pagoda serve` of two models whose budget holds one of them.

    python benchmarks/model_switch.py [--rounds 3] [--models smollm2-135m-instruct gemma3-270m]

The server runs with `--max-loaded-models 1`, so every request for the other model unloads the
loaded one (its engine stopped, its memory given back) and loads the one asked for; this is
what a user of Ollama on a small machine sees when switching models. Measured per request,
streamed, 16 tokens greedy, fast GGUF path (--quantization gguf):

- `cold A`: the first request for the first model (load + time to first token);
- `switch to X`: a request for the model that is not loaded (unload the other + load X + TTFT);
- `warm X`: the next request for the same model (TTFT only, the baseline);

and the server's own `pagoda:model_load_seconds` (the load alone). Writes
results/model-switch-<date>.json with the CPU flags and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import httpx

from pagoda.bench.servers import free_port, running

HERE = Path(__file__).parent


def ttft(base: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first token."""
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", timeout=600, json={
            "model": model, "prompt": "The three most useful things to pack for a long walk are", "max_tokens": 16,
            "temperature": 0, "stream": True}) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - start
                for _ in lines:  # the rest of the answer
                    pass
                return first
    raise RuntimeError("no token came back")


def load_seconds(base: str) -> dict[str, float]:
    """pagoda:model_load_seconds' sum and count per model, from /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        for part in ("_sum", "_count"):
            if line.startswith(f"pagoda:model_load_seconds{part}{{"):
                name = line.split('model_name="', 1)[1].split('"', 1)[0]
                out[f"{name}{part}"] = float(line.rsplit(" ", 1)[1])
    return out


def cpu_flags() -> list[str]:
    wanted = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile", "amx_int8", "amx_bf16"}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(wanted & set(line.split(":", 1)[1].split()))
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs=2, default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    a, b = args.models
    port = free_port()
    cmd = ["python", "-m", "pagoda.cli", "serve", "--model", a, "--model", b, "--port", str(port),
           "--quantization", "gguf", "--kv-cache-memory", "0.5", "--max-loaded-models", "1", "--log-level", "warning"]
    rows: dict[str, list[float]] = {f"cold {a}": [], f"switch to {b}": [], f"switch to {a}": [], f"warm {a}": [],
                                    f"warm {b}": []}
    with running(cmd, port) as base:
        rows[f"cold {a}"].append(ttft(base, a))
        rows[f"warm {a}"].append(ttft(base, a))
        for _ in range(args.rounds):
            for model in (b, a):
                rows[f"switch to {model}"].append(ttft(base, model))
                rows[f"warm {model}"].append(ttft(base, model))
        loads = load_seconds(base)
    summary = {kind: {"median_s": round(statistics.median(v), 3), "min_s": round(min(v), 3),
                      "max_s": round(max(v), 3), "n": len(v)} for kind, v in rows.items()}
    load_mean = {m: round(loads[f"{m}_sum"] / loads[f"{m}_count"], 3) for m in (a, b) if loads.get(f"{m}_count")}
    result = {"date": str(date.today()), "command": " ".join(cmd), "models": [a, b], "rounds": args.rounds,
              "cpu_flags": cpu_flags(), "ttft": summary, "mean_load_seconds": load_mean, "raw": rows}
    out = HERE / "results" / f"model-switch-{date.today()}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| request | median | min | max | n |\n| --- | --- | --- | --- | --- |")
    for kind, s in summary.items():
        print(f"| {kind} | {s['median_s']:.3f} s | {s['min_s']:.3f} s | {s['max_s']:.3f} s | {s['n']} |")
    print(f"mean load (server's pagoda:model_load_seconds): {load_mean}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
