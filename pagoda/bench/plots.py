"""PNG plots of concurrency sweeps (matplotlib, from the ``bench`` extra).

    pagoda bench plot results/a.json results/b.json --plot-dir results/   # several systems in one figure

Two figures: output tokens/s vs concurrency, and p99 TTFT and p99 ITL vs concurrency (with the TTFT
SLO drawn where the sweep had one). Concurrency is on a log-2 axis.
"""

from __future__ import annotations

import json
from pathlib import Path

THROUGHPUT_PNG = "throughput_vs_concurrency.png"
LATENCY_PNG = "latency_vs_concurrency.png"


def _pyplot():
    import matplotlib  # matplotlib (the bench extra) loads on first use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib (the bench extra) loads on first use

    return plt


def _series(record: dict, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    levels = record["levels"]
    return [lv["max_concurrency"] for lv in levels], [lv[key] * scale for lv in levels]


def _axis(ax, title: str, ylabel: str, levels: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)


def _save(plt, fig, path: Path) -> None:
    for ax in fig.axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweeps(records: list[dict], out_dir: str | Path) -> list[Path]:
    """Draw the sweeps (records as `run_sweep` returns them) into out_dir; returns the PNG paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    levels = sorted({lv["max_concurrency"] for rec in records for lv in rec["levels"]})
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for rec in records:
        x, y = _series(rec, "output_throughput")
        ax.plot(x, y, marker="o", label=rec["label"])
    _axis(ax, "Output throughput vs concurrency", "output tokens/s", levels)
    _save(plt, fig, out / THROUGHPUT_PNG)

    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4.4))
    for rec in records:
        x, y = _series(rec, "p99_ttft_ms", 1e-3)
        line, = ax_ttft.plot(x, y, marker="o", label=rec["label"])
        x, y = _series(rec, "p99_itl_ms")
        ax_itl.plot(x, y, marker="o", label=rec["label"], color=line.get_color())
    ttft_slos = {rec["slos_ms"].get("ttft") for rec in records} - {None}
    for slo in ttft_slos:
        ax_ttft.axhline(slo / 1e3, color="grey", linestyle="--", linewidth=1, label=f"TTFT SLO {slo / 1e3:g} s")
    _axis(ax_ttft, "p99 time to first token", "seconds", levels)
    _axis(ax_itl, "p99 inter-token latency", "milliseconds", levels)
    _save(plt, fig, out / LATENCY_PNG)
    return [out / THROUGHPUT_PNG, out / LATENCY_PNG]


def load_sweep(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if "sweep" not in data:
        raise ValueError(f"{path} is not a sweep result (run `pagoda bench serve --sweep-concurrency ... --save-result`)")
    return data["sweep"]


def main(paths: list[str], out_dir: str, labels: list[str] | None = None) -> list[Path]:
    records = [load_sweep(p) for p in paths]
    for rec, label in zip(records, labels or []):
        rec["label"] = label
    return plot_sweeps(records, out_dir)
