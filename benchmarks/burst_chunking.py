"""A burst of 64 arrivals over streams already decoding: what the chunking knobs trade.

    python benchmarks/burst_chunking.py                    # gguf and fp32, the default grid
    python benchmarks/burst_chunking.py --modes gguf --budgets 256,512,1024,2048 --thresholds 0,64
    python benchmarks/burst_chunking.py --plot benchmarks/results/burst-chunking-<date>.json   # plot only

In process, through ``LLMEngine.step`` (the loop ``LLM.generate`` runs; no server, no HTTP):
SmolLM2-135M-Instruct, ``--quantization gguf`` and the fp32 default. ``--streams`` (4) requests of
128 prompt tokens are decoding when ``--burst`` (64) requests of 128 prompt tokens, 64 output
tokens each, arrive in one instant. Each configuration sets ``--max-num-batched-tokens`` and
``--long-prefill-token-threshold`` (with a threshold, ``--max-num-partial-prefills`` and
``--max-long-partial-prefills`` are the burst's size, so the capped prefills share the budget:
vLLM v1's way). Per configuration:

- TTFT p50 / p99 of the burst: arrival to the step that gave its first token;
- ITL p99 / max of the already-running streams while the burst's prompts are being computed
  (from the arrival until the burst's last first token): what a user mid-answer sees;
- the burst's prefill rate: its prompt tokens / the time until its last first token (decodes
  of the streams and of the burst's early requests run in the same steps);
- the mean prefill tokens per step and the step count in that window.

The measurement stops when the burst's last request has its first token (everything is then
aborted): after that the steps are plain batch-68 decodes, the same for every configuration.
One engine per mode; the knobs are set on its scheduler between configurations (they are what
the flags set at start-up), and each configuration's prompts are fresh random tokens, so the
prefix cache never hits. Every configuration runs once per ``--rounds``, the rounds alternating
the grid's order, and the medians are reported: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's pagoda, not an installed one

MODES = {"gguf": "gguf", "fp32": None}  # label -> --quantization
PROMPT_LEN = 128
STREAM_WARM_TOKENS = 4  # tokens each running stream has produced before the burst arrives


def _prompt(rng: random.Random) -> dict:
    return {"prompt_token_ids": [rng.randrange(100, 40_000) for _ in range(PROMPT_LEN)]}


def run_burst(engine, budget: int, threshold: int, burst: int, streams: int, output_len: int, seed: int) -> dict:
    """One configuration on a warm engine: the knobs set, the streams started, the burst added."""
    from pagoda import SamplingParams
    from pagoda.core.prefill_chunks import PrefillChunking

    sched = engine.core.scheduler
    sched.max_num_batched_tokens = budget
    partial = burst if threshold else 1
    sched.chunking = PrefillChunking(threshold, partial, partial)
    rng = random.Random(seed)
    tag = f"{budget}-{threshold}-{seed}"
    stream_ids = [f"s{i}-{tag}" for i in range(streams)]
    long_params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    for rid in stream_ids:
        engine.add_request(rid, _prompt(rng), long_params)
    produced = {rid: 0 for rid in stream_ids}
    while min(produced.values()) < STREAM_WARM_TOKENS:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    burst_ids = [f"b{i}-{tag}" for i in range(burst)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    arrival = time.perf_counter()
    for rid in burst_ids:
        engine.add_request(rid, _prompt(rng), params)
    first_token: dict[str, float] = {}
    stream_times: dict[str, list[float]] = {rid: [arrival] for rid in stream_ids}
    steps = 0
    prefill_tokens = 0
    while len(first_token) < burst:
        before = {r.request_id: r.num_computed_tokens for r in sched.requests.values()}
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        prefill_tokens += sum(max(0, min(r.num_computed_tokens, r.num_prompt_tokens) - before.get(rid, 0))
                              for rid, r in sched.requests.items() if rid.startswith("b"))
        for out in outs:
            rid = out.request_id
            if rid in stream_times:
                stream_times[rid].append(now)
            elif rid not in first_token and out.outputs[0].token_ids:
                first_token[rid] = now - arrival
    window = max(first_token.values())
    for rid in stream_ids + burst_ids:
        engine.abort_request(rid)
    itls = [b - a for times in stream_times.values() for a, b in zip(times, times[1:])]
    ttfts = sorted(first_token.values())
    return {
        "max_num_batched_tokens": budget, "long_prefill_token_threshold": threshold,
        "max_num_partial_prefills": partial, "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
        "ttft_max_s": ttfts[-1], "stream_itl_p99_ms": 1e3 * _pct(itls, 99), "stream_itl_max_ms": 1e3 * max(itls),
        "stream_itl_mean_ms": 1e3 * statistics.fmean(itls), "burst_prefill_tok_s": burst * PROMPT_LEN / window,
        "steps": steps, "mean_prefill_tokens_per_step": prefill_tokens / steps,
    }


def _pct(values: list[float], q: float) -> float:
    from pagoda.bench.latency_stats import percentile

    return percentile(values, q)


def measure_mode(mode: str, grid: list[tuple[int, int]], ns: argparse.Namespace) -> list[dict]:
    import torch

    from pagoda import LLM

    llm = LLM(model="smollm2-135m-instruct", kv_cache_memory=ns.kv_cache_memory, quantization=MODES[mode],
              max_num_batched_tokens=max(b for b, _ in grid))
    engine = llm.engine
    # warm-up: kernels, allocator. The recorded runs used 8 requests, too few: the first
    # configuration after it still paid for first touches (benchmarks/README.md); use the burst's size.
    run_burst(engine, 2048, 0, ns.warmup_burst, 2, 4, seed=-1)
    runs: dict[tuple[int, int], list[dict]] = {key: [] for key in grid}
    for r in range(ns.rounds):
        order = grid if r % 2 == 0 else grid[::-1]
        for budget, threshold in order:
            row = run_burst(engine, budget, threshold, ns.burst, ns.streams, ns.output_len, seed=1000 * r + budget + threshold)
            runs[(budget, threshold)].append(row)
            print(f"{mode} budget {budget:5d} threshold {threshold:4d}: TTFT p50 {row['ttft_p50_s']:.2f} s "
                  f"p99 {row['ttft_p99_s']:.2f} s, stream ITL p99 {row['stream_itl_p99_ms']:.0f} ms "
                  f"max {row['stream_itl_max_ms']:.0f} ms, prefill {row['burst_prefill_tok_s']:.0f} tok/s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    llm.shutdown()
    rows = []
    for (budget, threshold), found in runs.items():
        row = {k: (statistics.median(r[k] for r in found) if isinstance(v, float) else v) for k, v in found[0].items()}
        rows.append({"mode": mode, **row, "rounds": len(found), "threads": torch.get_num_threads()})
    return rows


def plot(result: dict, path: Path) -> None:
    """TTFT p99 of the burst against the running streams' ITL p99, one point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for threshold, marker in zip(sorted({r["long_prefill_token_threshold"] for r in result["rows"]}), "os^Dv"):
            rows = sorted((r for r in result["rows"] if r["mode"] == mode and r["long_prefill_token_threshold"] == threshold),
                          key=lambda r: r["max_num_batched_tokens"])
            xs, ys = [r["stream_itl_p99_ms"] for r in rows], [r["ttft_p99_s"] for r in rows]
            ax.plot(xs, ys, marker=marker, label=f"--long-prefill-token-threshold {threshold}")
            for r, x, y in zip(rows, xs, ys):
                ax.annotate(str(r["max_num_batched_tokens"]), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
            p50 = [r["ttft_p50_s"] for r in rows]
            ax.plot(xs, p50, marker=marker, linestyle=":", alpha=0.6, label=f"TTFT p50, threshold {threshold}")
        ax.set_xlabel("running streams' ITL p99 during the burst (ms)")
        ax.set_ylabel("burst TTFT (s): p99 solid, p50 dotted")
        ax.set_title(f"SmolLM2 {mode}: 64 arrivals over 4 streams\n(labels: --max-num-batched-tokens)")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c", "amx")))
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="gguf,fp32")
    p.add_argument("--budgets", default="256,512,1024,2048", help="--max-num-batched-tokens values")
    p.add_argument("--thresholds", default="0,64", help="--long-prefill-token-threshold values")
    p.add_argument("--configs", default="", help="BUDGET:THRESHOLD pairs instead of the grid, e.g. 512:0,2048:64")
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup-burst", type=int, default=8, help="requests in the warm-up burst (64 is better)")
    p.add_argument("--kv-cache-memory", type=float, default=1.0)
    p.add_argument("--label", default="")
    p.add_argument("--plot", type=Path, help="only draw the plot of a result file")
    ns = p.parse_args()
    if ns.plot:
        plot(json.loads(ns.plot.read_text()), HERE / "results" / "plots" / (ns.plot.stem + ".png"))
        return 0
    if ns.configs:
        grid = [(int(b), int(t)) for b, t in (pair.split(":") for pair in ns.configs.split(","))]
    else:
        grid = [(int(b), int(t)) for t in ns.thresholds.split(",") for b in ns.budgets.split(",")]
    load_before = os.getloadavg()
    rows = []
    for mode in ns.modes.split(","):
        rows += measure_mode(mode, grid, ns)
    name = f"burst-chunking-{date.today()}{'-' + ns.label if ns.label else ''}"
    result = {
        "date": str(date.today()), "command": " ".join(["python", "benchmarks/burst_chunking.py", *sys.argv[1:]]),
        "cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "burst": ns.burst, "streams": ns.streams, "prompt_len": PROMPT_LEN, "output_len": ns.output_len, "rows": rows,
    }
    out = HERE / "results" / f"{name}.json"
    out.write_text(json.dumps(result, indent=1))
    plot(result, HERE / "results" / "plots" / f"{name}.png")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
