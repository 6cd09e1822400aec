"""The swap soak: one `pagoda serve` of two random-weight Llamas (hidden 1024 x 8 layers, ~206 MiB of
fp32 weights each) with `--max-loaded-models 1`, asked for each in turn (pagoda.bench.swap_soak),
so that every request unloads one model and loads the other. The server's RSS (its engine
processes' too, with --engine-process) after the last swap must stay within 10 % of the plateau
it reached once both models had loaded.

    python benchmarks/model_swap_soak.py [--swaps 100] [--engine-process] [--model PATH]

--model serves one model file or directory under two names (two links to it), for a real model.

Writes benchmarks/results/model-swap-soak-<mode>-<date>.json (the summary, every sample, the CPU)
and prints the summary. tests/entrypoints/test_model_swap_memory.py runs a short one in CI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from pagoda.bench.servers import free_port, pagoda_command, running_process  # noqa: E402
from pagoda.bench.swap_soak import MiB, swap  # noqa: E402
from soak import cpu_flags  # noqa: E402 - benchmarks/soak.py
from tiny_models import make_tiny_hf_model  # noqa: E402

SIZE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--swaps", type=int, default=100)
    p.add_argument("--engine-process", action="store_true", help="each model's engine in its own process")
    p.add_argument("--model", default=None, help="a real model (a GGUF file or a model directory), served as both")
    p.add_argument("--max-growth", type=float, default=10.0, help="fail above this RSS growth after the plateau, in %%")
    ns = p.parse_args()
    root = Path(tempfile.mkdtemp())
    try:
        if ns.model is None:
            first = make_tiny_hf_model("llama", root / "first", **SIZE)
            second = shutil.copytree(first, root / "second")
        else:  # two paths to one model: the server loads each as a model of its own
            source = Path(ns.model).expanduser().resolve()
            first, second = root / f"first{source.suffix}", root / f"second{source.suffix}"
            first.symlink_to(source)
            second.symlink_to(source)
        port = free_port()
        cmd = pagoda_command(str(first), port, "--model", str(second), "--served-model-name", "first", "second",
                             "--max-loaded-models", "1", "--keep-alive", "-1", "--dtype", "float32",
                             "--kv-cache-memory", "0.1", *(["--engine-process"] if ns.engine_process else []))
        with running_process(cmd, port, ready_path="/health") as (base, proc):
            report = swap(base, ["first", "second"], ns.swaps, proc.pid)
        weights = sum(f.stat().st_size for f in ([first] if first.is_file() else first.glob("*.safetensors")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mode = "process" if ns.engine_process else "thread"
    summary = {"mode": mode, "model": ns.model or "random Llama, hidden 1024 x 8 layers", "file_mib_per_model": round(weights / MiB), "cpu_flags": cpu_flags(),
               "command": " ".join(sys.argv), **report.summary()}
    name = "" if ns.model is None else Path(ns.model).stem.split(".")[0].lower() + "-"
    out = ROOT / "benchmarks" / "results" / f"model-swap-soak-{name}{mode}-{datetime.date.today()}.json"
    out.write_text(json.dumps({**summary, "rss_mib": [round(r / MiB, 1) for r in report.rss],
                               "swap_seconds": [round(s, 3) for s in report.seconds]}, indent=1) + "\n")
    print(json.dumps(summary, indent=2))
    return 1 if summary["growth_after_plateau_percent"] > ns.max_growth else 0


if __name__ == "__main__":
    raise SystemExit(main())
