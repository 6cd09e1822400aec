"""A swap soak: a server of several models asked for each in turn, so that with
`--max-loaded-models 1` every request unloads the loaded model and loads the one it names. The
server's resident memory (its engine processes' too), sampled after each swap, must stay at the
plateau it reached once every model had loaded.

    python -m pagoda.bench.swap_soak --base-url http://127.0.0.1:8000 --model a --model b --swaps 100 --pid 1234

benchmarks/model_swap_soak.py starts such a server on two random-weight models and runs this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagoda.bench.soak import rss_bytes

MiB = 1 << 20


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (an `--engine-process` server's engines), from /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return kids


@dataclass
class SwapReport:
    models: list[str]
    rss: list[int] = field(default_factory=list)  # bytes after each swap: the server and its children
    seconds: list[float] = field(default_factory=list)  # each swap's request: unload + load + answer

    @property
    def plateau(self) -> int:
        """RSS once every model has loaded once (the larger of that swap's and the next one's
        samples: the first unload's trim may still be settling)."""
        first = len(self.models) - 1
        return max(self.rss[first:first + 2])

    @property
    def end(self) -> int:
        """RSS at the end: the median of the last three samples, so one late collection does
        not decide it."""
        return int(statistics.median(self.rss[-3:]))

    def summary(self) -> dict:
        return {
            "models": self.models, "swaps": len(self.rss),
            "rss_mib_first_plateau_end_max": [round(self.rss[0] / MiB), round(self.plateau / MiB),
                                              round(self.end / MiB), round(max(self.rss) / MiB)],
            "growth_after_plateau_percent": round(100 * (self.end - self.plateau) / self.plateau, 1),
            "swap_seconds_median_max": [round(statistics.median(self.seconds), 2), round(max(self.seconds), 2)],
        }


def swap(base_url: str, models: list[str], swaps: int, server_pid: int | None = None) -> SwapReport:
    """Ask for `models` in turn, `swaps` requests in all (a short greedy completion each);
    sample the server's RSS (with its children's) after each if `server_pid` is given."""
    report = SwapReport(models=list(models))
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for i in range(swaps):
            start = time.monotonic()
            r = client.post("/v1/completions", json={"model": models[i % len(models)], "prompt": "Hello there",
                                                     "max_tokens": 4, "temperature": 0})
            if r.status_code != 200:
                raise RuntimeError(f"swap {i} to {models[i % len(models)]}: {r.status_code} {r.text[:300]}")
            report.seconds.append(time.monotonic() - start)
            if server_pid is not None:
                report.rss.append(rss_bytes([server_pid, *child_pids(server_pid)]))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.swap_soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", action="append", required=True, help="a served model's name (give two or more)")
    p.add_argument("--swaps", type=int, default=100)
    p.add_argument("--pid", type=int, required=True, help="the server's process (its children are counted too)")
    p.add_argument("--max-growth", type=float, default=10.0, help="fail above this RSS growth after the plateau, in %%")
    ns = p.parse_args(argv)
    report = swap(ns.base_url, ns.model, ns.swaps, ns.pid)
    summary = report.summary()
    print(json.dumps(summary, indent=2))
    return 1 if summary["growth_after_plateau_percent"] > ns.max_growth else 0


if __name__ == "__main__":
    raise SystemExit(main())
