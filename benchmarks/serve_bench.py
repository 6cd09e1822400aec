"""Serving benchmark: several servers, one after another, under the same load, in one run.

    python benchmarks/serve_bench.py                                  # pagoda and the naive transformers server
    python benchmarks/serve_bench.py --systems pagoda,llamacpp,llama-server --llama-server /path/to/llama-server

Each system is started on 127.0.0.1, swept over its concurrencies with `pagoda bench serve`'s
machinery (streaming /v1/completions, token-exact text prompts of --input-len tokens, exactly
--output-len output tokens, greedy), then stopped. The result JSON holds every sweep, the table
prints the seed's columns (throughput, TTFT, ITL, the largest concurrency meeting the SLOs), and
--plot-dir gets the sweeps drawn together. To measure a server that is already running, use
`pagoda bench serve --base-url URL --sweep-concurrency ...` directly.

--rounds N repeats the whole pass N times, the systems alternating (a fresh server each time, so
no round sees another's prefix cache), and prints each level's median over the rounds with the
ratio of every system's to the last one's: on a shared machine whose speed drifts by 15 % from one
minute to the next, one run of each is not a comparison.

Systems:
  pagoda          pagoda serve (engine core on a thread, the default)
  pagoda-process  pagoda serve --engine-process
  pagoda-gguf     pagoda serve --quantization gguf (the GGUF's own blocks, as llama.cpp runs them)
  hf              transformers served one request at a time (python -m pagoda.bench.hf_server)
  llamacpp        llama-cpp-python's server on the model's GGUF (one request at a time)
  llama-server    llama.cpp's own server binary (--llama-server PATH), one slot per client of the largest level
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path

from pagoda.bench import baselines, datasets, plots, serve, servers, sweep
from pagoda.bench.latency_stats import parse_slos

HERE = Path(__file__).resolve().parent
SYSTEMS = ("pagoda", "pagoda-process", "pagoda-gguf", "hf", "llamacpp", "llama-server")
LABELS = {"pagoda": "pagoda serve", "pagoda-process": "pagoda serve --engine-process",
          "pagoda-gguf": "pagoda serve --quantization gguf",
          "hf": "transformers, one request at a time", "llamacpp": "llama-cpp-python server",
          "llama-server": "llama.cpp llama-server"}


def command_for(system: str, ns: argparse.Namespace, port: int, levels: list[int]) -> tuple[list[str], dict]:
    """(command line, request fields it needs) of one system."""
    n_ctx = ns.input_len + ns.output_len + 64
    if system in ("pagoda", "pagoda-process", "pagoda-gguf"):
        extra = {"pagoda-process": ["--engine-process"], "pagoda-gguf": ["--quantization", "gguf"]}.get(system, [])
        return servers.pagoda_command(ns.model, port, "--kv-cache-memory", str(ns.kv_cache_memory), *extra), {}
    if system == "hf":
        return servers.hf_naive_command(ns.model, port), {}
    gguf = baselines.gguf_file(ns.model)
    if gguf is None:
        raise baselines.Unavailable(f"llama.cpp needs a GGUF model; {ns.model!r} is not one")
    if system == "llamacpp":
        cmd = baselines.llamacpp_server_command(gguf, port, n_ctx=n_ctx, threads=ns.threads, model_alias=ns.model)
        # A new request must queue, not interrupt the one streaming; min_tokens holds the output length.
        return cmd + ["--interrupt_requests", "False"], {"min_tokens": ns.output_len}
    if not ns.llama_server or not Path(ns.llama_server).exists():
        raise baselines.Unavailable("no llama-server binary (pass --llama-server PATH)")
    slots = max(levels)
    threads = str(ns.threads or baselines.default_threads())
    return [ns.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(n_ctx * slots), "-t", threads, "-tb", threads, "--alias", ns.model, "--no-webui"], {}


def run_system(system: str, ns: argparse.Namespace, tokenizer, slos) -> dict | str:
    """One system's sweep on a server of its own; the reason instead where it cannot run here."""
    levels = sweep.parse_levels(ns.slow_concurrency if system in ("hf", "llamacpp") else ns.concurrency)
    port = servers.free_port()
    try:
        cmd, extra_body = command_for(system, ns, port, levels)
    except baselines.Unavailable as e:
        print(f"skipping {system}: {e}", file=sys.stderr)
        return str(e)
    print(f"{system}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    with servers.running(cmd, port) as base:
        cfg = serve.ServeConfig(base_url=base, model=ns.model, extra_body=extra_body, probe_path=ns.probe,
                                seed=ns.seed)

        def make(level: int) -> list[datasets.SampleRequest]:
            return datasets.random_requests(level, ns.input_len, ns.output_len, tokenizer=tokenizer, seed=ns.seed)

        record = sweep.run_sweep(cfg, levels, make, tokenizer=tokenizer, slos=slos, attainment=ns.slo_attainment,
                                 percentiles=(50, 90, 99), label=LABELS[system])
    record["system"], record["command"] = system, cmd
    return record


def median_table(records: list[dict], systems: list[str]) -> str:
    """Each system's median output tok/s and TTFT p99 per concurrency over the rounds, and its
    throughput over the last system's (the baseline, e.g. llama-server) at the same level."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        for level in record["levels"]:
            runs.setdefault((record["system"], level["max_concurrency"]), []).append(level)
    baseline = systems[-1]
    lines = ["medians over the rounds", " system            conc  rounds  out tok/s   TTFT p99   vs " + baseline]
    for (system, conc), levels in sorted(runs.items(), key=lambda kv: (kv[0][1], systems.index(kv[0][0]))):
        tok = statistics.median(x["output_throughput"] for x in levels)
        ttft = statistics.median(x["p99_ttft_ms"] for x in levels) / 1000
        base = runs.get((baseline, conc))
        ratio = tok / statistics.median(x["output_throughput"] for x in base) if base else float("nan")
        each = ", ".join(f"{x['output_throughput']:.1f}" for x in levels)
        lines.append(f" {system:<17} {conc:>4}  {len(levels):>6}  {tok:>9.1f}  {ttft:>8.2f}s   {ratio:.2f}x   (each: {each})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="pagoda,hf", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--concurrency", default="1,4,16,64", help="levels of the sweep")
    ap.add_argument("--slow-concurrency", default="1,4,8",
                    help="levels for the systems that serve one request at a time (hf, llamacpp)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--goodput", nargs="+", default=["ttft:5000", "tpot:500"], metavar="NAME:MS")
    ap.add_argument("--slo-attainment", type=float, default=0.99)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary")
    ap.add_argument("--probe", default=None, metavar="PATH", help="also time GET PATH (e.g. /health) during the load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="JSON path (default: benchmarks/results/serve-<date>.json)")
    ap.add_argument("--plot-dir", default=None, help="draw the sweeps here")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the systems, alternating; medians printed")
    ns = ap.parse_args()

    systems = [s.strip() for s in ns.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    slos = parse_slos(ns.goodput)
    tokenizer = datasets.load_tokenizer(ns.model)
    records, skipped = [], {}
    for round_index in range(ns.rounds):
        for system in systems:
            if system in skipped:
                continue
            record = run_system(system, ns, tokenizer, slos)
            if isinstance(record, str):
                skipped[system] = record
                continue
            record["round"] = round_index
            records.append(record)
            print(sweep.format_table(record), flush=True)
    if ns.rounds > 1:
        print(median_table(records, systems))

    save = Path(ns.save) if ns.save else HERE / "results" / f"serve-{date.today().isoformat()}.json"
    save.parent.mkdir(parents=True, exist_ok=True)
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    save.write_text(json.dumps({"date": date.today().isoformat(), "command": " ".join(sys.argv), "args": vars(ns),
                                "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(),
                                "sweeps": records, "skipped": skipped}, indent=2, default=str))
    print(f"saved {save}")
    if ns.plot_dir and records:
        for path in plots.plot_sweeps(records, ns.plot_dir):
            print(f"plot {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
