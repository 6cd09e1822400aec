"""`pagoda bench serve`: one load against a server, or a sweep of concurrency levels (sweep.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pagoda.bench import datasets, serve, sweep
from pagoda.bench.latency_stats import format_summary, parse_slos


def main(ns: argparse.Namespace) -> int:
    tokenizer = datasets.load_tokenizer(ns.tokenizer or ns.model)
    if tokenizer is None:
        if ns.tokenizer:
            raise ValueError(f"--tokenizer {ns.tokenizer!r} is not a local model directory, .gguf file or catalog name")
        print("note: no tokenizer (pass --tokenizer MODEL): prompt lengths are estimates and output tokens "
              "come from the server's usage or the chunk count", file=sys.stderr)
    slos = parse_slos(ns.goodput)
    percentiles = serve.parse_percentiles(ns.percentiles)
    cfg = serve.config_from_args(ns)
    label = ns.label or cfg.base_url
    if ns.sweep_concurrency:
        return sweep.main(ns, cfg, tokenizer, slos, percentiles, label)
    requests = datasets.build_requests(ns, tokenizer, ns.num_prompts or 64, as_text=ns.prompt_format == "text")
    summary, _ = asyncio.run(serve.benchmark(cfg, requests, tokenizer=tokenizer, slos=slos, percentiles=percentiles,
                                             warmup=ns.warmup))
    print(format_summary(summary, f"Serving Benchmark Result: {label}"))
    if ns.save_result:
        serve.save_json(ns.save_result, {**serve.environment(ns), "label": label, "model": cfg.model, "result": summary})
    return 0 if summary["completed"] else 1
