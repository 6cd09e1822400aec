"""A change's speed check: two source trees of pagoda, alternated on one machine, each on its own code.

    git worktree add --detach /tmp/before c9fb1a7
    python benchmarks/before_after.py --before /tmp/before --after . --rounds 4

Each round runs, for each tree (ABBA order, so a drifting machine favours neither): offline
throughput (`pagoda bench throughput`, 64 requests of 128 prompt and 128 output tokens, the default
model) and a served sweep (`pagoda serve`, then `pagoda bench serve` at 1 and 16 concurrent
streams, 16 requests of 128 / 64 tokens). Each tree runs from its own directory with its own
`$PAGODA_HOME` (the pulled models linked from yours, the kernels built once per tree): a tree's
kernel library is rebuilt whenever another tree's sources are newer, so sharing one would rebuild
it every run. Prints the medians and after / before ratios and saves them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import date
from pathlib import Path

PORT = 8123


def _cli_module(tree: Path) -> str:
    """The tree's command-line module (it moved from entrypoints/ to the package's top)."""
    return "pagoda.cli" if (tree / "pagoda" / "cli.py").exists() else "pagoda.entrypoints.cli"


def _home(name: str, work: Path) -> Path:
    home = work / f"home-{name}"
    (home / "kernels").mkdir(parents=True, exist_ok=True)
    real_models = Path(os.environ.get("PAGODA_HOME") or Path.home() / ".cache" / "pagoda") / "models"
    if not (home / "models").exists():
        (home / "models").symlink_to(real_models)
    return home


def _pagoda(tree: Path, home: Path, *args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PAGODA_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-m", _cli_module(tree), *args], cwd=tree, env=env, **popen)


def _wait_healthy(timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def run_tree(tree: Path, home: Path, out: Path, tag: str) -> dict:
    offline = out / f"offline-{tag}.json"
    with open(out / f"offline-{tag}.log", "w") as log:
        _pagoda(tree, home, "bench", "throughput", "--backend", "pagoda", "--num-prompts", "64", "--input-len", "128",
                "--output-len", "128", "--kv-cache-memory", "2", "--save-result", str(offline),
                stdout=log, stderr=subprocess.STDOUT).wait()
    with open(out / f"serve-{tag}.log", "w") as log:
        server = _pagoda(tree, home, "serve", "--port", str(PORT), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy()
            served = out / f"served-{tag}.json"
            with open(out / f"served-{tag}.log", "w") as blog:
                _pagoda(tree, home, "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}", "--num-prompts", "16",
                        "--input-len", "128", "--output-len", "64", "--sweep-concurrency", "1,16",
                        "--save-result", str(served), stdout=blog, stderr=subprocess.STDOUT).wait()
        finally:
            server.terminate()
            server.wait()
    levels = json.loads(served.read_text())["sweep"]["levels"]
    return {"offline": json.loads(offline.read_text())["results"][0]["output_tokens_per_s"],
            "served_1": levels[0]["output_throughput"], "served_16": levels[1]["output_throughput"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagoda-before-after"))
    parser.add_argument("--save", type=Path,
                        default=Path(__file__).parent / "results" / f"before-after-{date.today().isoformat()}.json")
    ns = parser.parse_args()
    ns.work.mkdir(parents=True, exist_ok=True)
    trees = {"before": ns.before.resolve(), "after": ns.after.resolve()}
    homes = {name: _home(name, ns.work) for name in trees}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(1, ns.rounds + 1):
        for name in (("before", "after") if r % 2 else ("after", "before")):
            runs[name].append(run_tree(trees[name], homes[name], ns.work, f"{name}-{r}"))
            print(f"round {r}, {name}: {runs[name][-1]}", flush=True)
    summary = {}
    for key in ("offline", "served_1", "served_16"):
        before = statistics.median(x[key] for x in runs["before"])
        after = statistics.median(x[key] for x in runs["after"])
        summary[key] = {"before": round(before, 1), "after": round(after, 1), "ratio": round(after / before, 3)}
        print(f"{key}: before {before:.1f}, after {after:.1f} output tok/s, after / before {after / before:.3f}")
    ns.save.write_text(json.dumps({"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                                   "trees": {k: str(v) for k, v in trees.items()}, "runs": runs, "medians": summary},
                                  indent=1))
    print(f"saved {ns.save}")


if __name__ == "__main__":
    main()
