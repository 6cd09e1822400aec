"""One stream's decode across model sizes and GGUF types, pagoda against llama.cpp's llama-server
in one run per point, with the memory-bandwidth roofline.

    python benchmarks/size_sweep.py --llama-server /path/to/llama-server \\
        --llama-quantize /path/to/llama-quantize --shapes 135m,360m,1b,3b --types Q4_0,Q4_K_M,Q8_0

For each shape x type: the random-weight GGUF of that shape (real_shapes.py; made once, kept in
--files), then one_stream.py on it with `pagoda serve` (the default mode: the file's own blocks)
and llama-server (`-np 1`), alternated over --rounds rounds (a 100-token prompt, 64 tokens out,
greedy). The machine's read bandwidth (memory_bandwidth.py) bounds one stream: each token reads
every weight once, so tokens/s <= GB/s / model GB. It is measured at the start (the plot's line)
and again just before and after each point, whose fraction of the roofline takes the larger.
Writes results/size-sweep-<date>.json and size-sweep-<date>.png (tokens/s against model bytes,
both systems, and the bandwidth line).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memory_bandwidth  # noqa: E402
import real_shapes  # noqa: E402


def one_point(path: Path, ns: argparse.Namespace) -> dict:
    """one_stream.py's medians for pagoda serve and llama-server on one file."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        save = Path(out.name)
    cmd = [sys.executable, str(HERE / "one_stream.py"), "--model", str(path), "--quantizations", "auto",
           "--paths", "pagoda=serve:.,llama-server=llama-server", "--llama-server", ns.llama_server,
           "--rounds", str(ns.rounds), "--input-len", "100", "--output-len", "64", "--save", str(save)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(save.read_text())["results"]["auto"]
    save.unlink()
    return {name: {k: m[k] for k in ("decode_tok_s", "itl_p50_ms", "ttft_ms")} for name, m in result["median"].items()}


def plot(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = record["points"]
    for system, marker in (("pagoda", "o"), ("llama-server", "s")):
        xs = [p["bytes"] / 1e9 for p in points if system in p["tok_s"]]
        ys = [p["tok_s"][system] for p in points if system in p["tok_s"]]
        ax.scatter(xs, ys, marker=marker, label=system)
        for p in points:
            if system == "pagoda":
                ax.annotate(f"{p['shape']} {p['type']}", (p["bytes"] / 1e9, p["tok_s"][system]), fontsize=7,
                            xytext=(4, 2), textcoords="offset points")
    gbs = record["bandwidth_gb_s"]["read"]
    span = [min(p["bytes"] for p in points) / 1e9 * 0.8, max(p["bytes"] for p in points) / 1e9 * 1.2]
    grid = [span[0] * (span[1] / span[0]) ** (i / 50) for i in range(51)]
    ax.plot(grid, [gbs / x for x in grid], "k--", linewidth=1, label=f"read bandwidth {gbs:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model file size (GB)")
    ax.set_ylabel("one stream's decode (tokens/s)")
    ax.set_title(f"{record['cpu']}, {record['nproc']} cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="135m,360m,1b,3b")
    ap.add_argument("--types", default="Q4_0,Q4_K_M,Q8_0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--files", type=Path, default=Path(tempfile.gettempdir()) / "pagoda-shapes")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--llama-quantize", required=True)
    ap.add_argument("--save", type=Path, default=None)
    ns = ap.parse_args()
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    record = {"date": date.today().isoformat(), "command": " ".join(sys.argv), "cpu": cpu_model(),
              "cpu_flags": benchmark_cpu_flags(), "nproc": os.cpu_count(),
              "bandwidth_gb_s": memory_bandwidth.measure(1024, 20), "points": []}
    print(f"read bandwidth {record['bandwidth_gb_s']['read']:.1f} GB/s", flush=True)
    save = ns.save or HERE / "results" / f"size-sweep-{record['date']}.json"
    for shape in ns.shapes.split(","):
        types = ns.types.split(",")
        paths = real_shapes.make(shape, types, ns.files, ns.llama_quantize)
        for qtype in types:
            size = paths[qtype].stat().st_size
            before = memory_bandwidth.measure(1024, 8)["read"]
            medians = one_point(paths[qtype], ns)
            after = memory_bandwidth.measure(1024, 8)["read"]
            tok_s = {name: m["decode_tok_s"] for name, m in medians.items()}
            # this VM's bandwidth moves by a quarter within minutes: each point against the read
            # measured just before and just after it, the larger of the two (never flattering)
            roof = max(before, after) * 1e9 / size
            record["points"].append({"shape": shape, "type": qtype, "bytes": size, "tok_s": tok_s, "medians": medians,
                                     "read_gb_s": [before, after], "roofline_tok_s": roof})
            print(f"{shape} {qtype} {size / 2**20:.0f} MiB: " + ", ".join(f"{k} {v:.1f} tok/s ({v / roof:.0%} of the "
                  f"roofline)" for k, v in tok_s.items()), flush=True)
            save.write_text(json.dumps(record, indent=2))  # after every point: a long run keeps what it measured
    plot(record, save.with_suffix(".png"))
    print(f"saved {save} and {save.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
