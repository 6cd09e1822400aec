"""The long soak: 10,000 mixed requests (pagoda.bench.soak) against the tiny test model, with the
engine on a thread and in its own process, one after the other in one run.

    python benchmarks/soak.py [--requests 10000] [--concurrency 16]

Writes benchmarks/results/soak-<mode>-<date>.json (the summary, the RSS samples and the CPU) and
prints the problems found (none expected). tests/entrypoints/test_soak.py runs the same check,
shorter, in CI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from pagoda.bench.servers import free_port, pagoda_command, running  # noqa: E402
from pagoda.bench.soak import check, soak  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
            return " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
    return ""


def server_pids(port: int) -> list[int]:
    """The server listening on `port` and its engine process, found through /proc."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and str(port).encode() in args:
            pids.append(int(cmdline.parent.name))
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) in pids and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return pids


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=16)
    ns = p.parse_args()
    model = make_tiny_hf_model("llama", Path(tempfile.mkdtemp()) / "tiny", seed=0)
    failed = False
    for mode, extra in (("thread", []), ("process", ["--engine-process"])):
        port = free_port()
        cmd = pagoda_command(str(model), port, "--dtype", "float32", "--kv-cache-memory", "0.02",
                             "--served-model-name", "tiny", *extra)
        with running(cmd, port, ready_path="/health") as base:
            pids = server_pids(port)
            report = soak(base, ns.requests, concurrency=ns.concurrency, seed=0, pids=pids)
        problems = check(report)
        failed |= bool(problems)
        summary = {"mode": mode, "pids": len(pids), "cpu_flags": cpu_flags(), "command": " ".join(sys.argv),
                   **report.summary(), "problems": problems, "rss_samples": report.rss_samples}
        out = ROOT / "benchmarks" / "results" / f"soak-{mode}-{datetime.date.today()}.json"
        out.write_text(json.dumps(summary, indent=1) + "\n")
        print(mode, json.dumps({k: v for k, v in summary.items() if k not in ("rss_samples", "metrics_delta")}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
