"""A concurrency sweep: the same load at each level, and the largest level that meets the SLOs.

A level meets the SLOs when no request failed and at least ``--slo-attainment`` (default 99 %) of
its requests met every SLO of ``--goodput`` (default ``ttft:5000 tpot:500``). The largest such
level is the "max concurrency" column of a benchmark table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys

from pagoda.bench import datasets, plots, serve

DEFAULT_SLOS = {"ttft": 5000.0, "tpot": 500.0}


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep-concurrency takes integers like 1,4,16,64, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--sweep-concurrency levels must be >= 1, got {text!r}")
    return sorted(set(levels))


def level_passes(summary: dict, attainment: float) -> bool:
    return summary["failed"] == 0 and summary["completed"] > 0 and summary.get("slo_attainment", 0.0) >= attainment


def max_concurrency_meeting(levels: list[dict], attainment: float) -> int | None:
    """The largest concurrency whose level passes, or None when none does."""
    passing = [lv["max_concurrency"] for lv in levels if level_passes(lv, attainment)]
    return max(passing) if passing else None


def format_table(record: dict) -> str:
    head = (f"{'conc':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'goodput':>8} {'SLO met':>8}")
    lines = [f"sweep of {record['label']} (SLOs {' '.join(f'{k}:{v:g}ms' for k, v in record['slos_ms'].items())}, "
             f"attainment >= {record['slo_attainment']:.0%})", head]
    for lv in record["levels"]:
        lines.append(f"{lv['max_concurrency']:>5} {lv['request_throughput']:>7.2f} {lv['output_throughput']:>9.1f} "
                     f"{lv['median_ttft_ms'] / 1e3:>8.2f}s {lv['p99_ttft_ms'] / 1e3:>8.2f}s {lv['p99_tpot_ms']:>7.0f}ms "
                     f"{lv['median_itl_ms']:>6.0f}ms {lv['p99_itl_ms']:>6.0f}ms {lv['goodput']:>8.2f} "
                     f"{lv['slo_attainment']:>7.0%}{'' if lv['meets_slo'] else ' x'}")
    best = record["max_concurrency_meeting_slo"]
    lines.append(f"max concurrency meeting the SLOs: {best if best is not None else 'none of the levels'}")
    return "\n".join(lines)


def run_sweep(cfg: serve.ServeConfig, levels: list[int], make_requests, *, tokenizer=None, slos: dict[str, float],
              attainment: float, percentiles, warmup: bool = True, label: str = "") -> dict:
    """Run each level (``make_requests(level)`` gives its requests); returns the sweep's record."""
    results = []
    for i, level in enumerate(levels):
        level_cfg = dataclasses.replace(cfg, max_concurrency=level, request_rate=math.inf)
        summary, _ = asyncio.run(serve.benchmark(level_cfg, make_requests(level), tokenizer=tokenizer, slos=slos,
                                                 percentiles=percentiles, warmup=warmup and i == 0))
        cfg.model = level_cfg.model  # resolved from the server once
        summary["meets_slo"] = level_passes(summary, attainment)
        results.append(summary)
        print(f"  concurrency {level}: {summary['output_throughput']:.1f} output tok/s, "
              f"TTFT p99 {summary['p99_ttft_ms'] / 1e3:.2f} s, ITL p99 {summary['p99_itl_ms']:.0f} ms, "
              f"SLOs met by {summary['slo_attainment']:.0%}", file=sys.stderr, flush=True)
    return {"label": label, "model": cfg.model, "slos_ms": slos, "slo_attainment": attainment, "levels": results,
            "max_concurrency_meeting_slo": max_concurrency_meeting(results, attainment)}


def main(ns: argparse.Namespace, cfg: serve.ServeConfig, tokenizer, slos: dict[str, float], percentiles, label: str) -> int:
    levels = parse_levels(ns.sweep_concurrency)
    if not slos:
        slos = dict(DEFAULT_SLOS)
        print(f"note: no --goodput given; the sweep uses ttft:{slos['ttft']:g} tpot:{slos['tpot']:g} (ms)", file=sys.stderr)
    record = run_sweep(cfg, levels, lambda level: datasets.build_requests(
        ns, tokenizer, ns.num_prompts or level, as_text=ns.prompt_format == "text"),
                       tokenizer=tokenizer, slos=slos, attainment=ns.slo_attainment, percentiles=percentiles,
                       warmup=ns.warmup, label=label)
    print(format_table(record))
    if ns.save_result:
        serve.save_json(ns.save_result, {**serve.environment(ns), "sweep": record})
    if ns.plot_dir:
        try:
            for path in plots.plot_sweeps([record], ns.plot_dir):
                print(f"plot {path}")
        except ImportError:
            print("note: matplotlib is not installed (pip install 'pagoda[bench]'): no plots", file=sys.stderr)
    return 0 if all(lv["completed"] for lv in record["levels"]) else 1
