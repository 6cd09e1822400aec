"""`pagoda tune`: find the serving flags with the most goodput under latency SLOs, by measuring.

    pagoda tune --model smollm2 --slo-ttft-p99 2s --slo-itl-p99 150ms --input-len 128 --output-len 64 \\
        --budget-seconds 360 -o smollm2.yaml --plot trials.png
    pagoda serve --config smollm2.yaml

Each trial starts `pagoda serve` with one setting and loads it with `pagoda bench serve`'s
streaming clients at rising concurrency until it misses an SLO; the setting's goodput is the
request rate of its best level whose p99 TTFT and p99 ITL meet the SLOs. The search (see
pagoda/tune/search.py) moves one knob at a time from the engine flags given (the defaults unless
told), in far fewer trials than the grid. It prints the table of trials and the best setting, and
writes it as a config file for `pagoda serve --config`. SLOs take a unit (2s, 150ms); a bare
number is milliseconds.
"""

from __future__ import annotations

import argparse
import signal
import sys

from pagoda.bench import datasets
from pagoda.engine_args import EngineArgs
from pagoda.loader.resolve import resolve_model
from pagoda.tune.setting import KNOBS, Setting

WORKLOAD_OPTIONS = ("input_len", "output_len", "range_ratio", "dataset")


def parse_ms(text: str) -> float:
    """"2s", "150ms" or "150" (milliseconds) -> milliseconds; ValueError otherwise."""
    t = str(text).strip().lower()
    scale = 1.0
    if t.endswith("ms"):
        t = t[:-2]
    elif t.endswith("s"):
        t, scale = t[:-1], 1000.0
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration such as 2s, 150ms or 150 (ms), got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"an SLO must be > 0, got {text!r}")
    return value


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("objectives")
    g.add_argument("--slo-ttft-p99", type=parse_ms, required=True, metavar="TIME",
                   help="99th percentile time to first token to stay within, e.g. 2s")
    g.add_argument("--slo-itl-p99", type=parse_ms, required=True, metavar="TIME",
                   help="99th percentile inter-token latency to stay within, e.g. 150ms")
    g.add_argument("--slo-headroom", type=float, default=0.1,
                   help="a trial passes only within (1 - headroom) x the SLOs, so that the chosen setting "
                        "still meets them when run again")
    datasets.add_cli_args(p, seed=False, num_prompts_help="requests per load level (default: two per client, at least 4)")
    p.add_argument("--workload", dest="dataset", default=None, metavar="FILE.jsonl",
                   help="the same as --dataset: a JSONL file of prompts, as `pagoda bench serve` reads")
    g = p.add_argument_group("search")
    g.add_argument("--budget-trials", type=int, default=None, help="at most this many trials (default 12 "
                   "unless --budget-seconds is given)")
    g.add_argument("--budget-seconds", type=float, default=None, help="start no trial that would end later than this")
    g.add_argument("--knobs", default=",".join(KNOBS), help="the knobs to tune, comma-separated")
    g.add_argument("--start-concurrency", type=int, default=4, help="the first trial's first load level")
    g.add_argument("--max-concurrency", type=int, default=64, help="the highest load level tried")
    g.add_argument("--min-gain", type=float, default=0.03,
                   help="a change is kept when it raises goodput by more than this share")
    g = p.add_argument_group("output")
    g.add_argument("-o", "--output", default=None, metavar="FILE.yaml", help="write the best setting here")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="plot the trials (needs matplotlib)")
    g.add_argument("--save-result", default=None, metavar="FILE.json", help="every trial and level, as JSON")


def _check(ns: argparse.Namespace) -> tuple[str, ...]:
    knobs = tuple(k.strip() for k in ns.knobs.split(",") if k.strip())
    unknown = [k for k in knobs if k not in KNOBS]
    if unknown:
        raise ValueError(f"--knobs: unknown knob(s) {', '.join(unknown)}; the knobs are {', '.join(KNOBS)}")
    for name in ("budget_trials", "start_concurrency", "max_concurrency"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.budget_seconds is not None and ns.budget_seconds <= 0:
        raise ValueError(f"--budget-seconds must be > 0, got {ns.budget_seconds}")
    if not 0 <= ns.slo_headroom < 1:
        raise ValueError(f"--slo-headroom must be in [0, 1), got {ns.slo_headroom}")
    return knobs


def _auto_dtype(args) -> str:
    """What `--dtype auto` resolves to on the engine's device (float32 on the CPU)."""
    import torch  # torch loads on first use

    from pagoda.dtypes import resolve_dtype  # deferred: loads torch
    from pagoda.platform import default_device  # deferred: loads torch

    device = torch.device(args.device) if args.device else default_device()
    return str(resolve_dtype("auto", device)).removeprefix("torch.")


def main(ns: argparse.Namespace) -> int:
    from pagoda.tune import report  # deferred: loads httpx, numpy
    from pagoda.tune.search import Budget, Search  # deferred: loads httpx, numpy
    from pagoda.tune.trial import Slos, Workload, run_trial  # deferred: loads httpx, numpy

    knobs = _check(ns)
    # SIGTERM ends the search as Ctrl-C does: through `finally`, so the trial's server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    base = EngineArgs.from_cli_args(ns)
    base._validate()
    slos = Slos(ns.slo_ttft_p99, ns.slo_itl_p99, ns.slo_headroom)
    workload = Workload(input_len=ns.input_len, output_len=ns.output_len, range_ratio=ns.range_ratio,
                        dataset=ns.dataset, seed=base.seed, num_prompts=ns.num_prompts,
                        tokenizer=datasets.load_tokenizer(base.model))
    workload.requests(1)  # a bad --workload file fails now, not in the first trial
    budget = Budget(trials=ns.budget_trials if ns.budget_trials or ns.budget_seconds else 12,
                    seconds=ns.budget_seconds)
    start = Setting.from_engine_args(base)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def run(index: int, setting: Setting, start_concurrency: int, reason: str):
        return run_trial(index, setting, base, workload, slos, start_concurrency=start_concurrency,
                         max_concurrency=ns.max_concurrency, reason=reason, log=log)

    search = Search(start, run, slos, budget, knobs=knobs, model_is_gguf=resolve_model(base.model).gguf_file is not None,
                    start_concurrency=ns.start_concurrency, max_concurrency=ns.max_concurrency,
                    min_gain=ns.min_gain, auto_dtype=_auto_dtype(base), log=log)
    best = search.run()
    print(report.format_table(search.trials, start, slos, best))
    workload_text = (f"{ns.dataset}" if ns.dataset else f"{ns.input_len} prompt / {ns.output_len} output tokens") + \
        f", {f'{workload.num_prompts} requests' if workload.num_prompts else f'{workload.rounds} requests per client'} a level"
    if ns.save_result:
        extra = {"command": "pagoda " + " ".join(getattr(ns, "argv", sys.argv[1:])), "workload": workload_text}
        print(f"saved {report.save_json(ns.save_result, report.record(search.trials, start, best, slos, base, extra))}")
    if ns.plot:
        try:
            print(f"plot {report.plot(search.trials, best, slos, ns.plot)}")
        except ImportError:
            print("note: matplotlib is not installed (pip install 'pagoda[bench]'): no plot", file=sys.stderr)
    if best is None:
        print("no setting met the SLOs at any load level: loosen the SLOs or check the trials' errors", file=sys.stderr)
        return 1
    lv = best.best
    print(f"best: trial {best.index}, {best.setting.describe(start)}: {lv.goodput:.2f} requests/s "
          f"({lv.summary['output_throughput']:.1f} output tok/s) at concurrency {lv.concurrency}")
    if ns.output:
        print(f"wrote {report.write_config(ns.output, best, base, slos, workload_text)} "
              f"(pagoda serve --config {ns.output})")
    return 0
