"""What `pagoda tune` hands back: the table of trials, the config file, a JSON record and a plot."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from pagoda.bench.plots import _pyplot
from pagoda.engine_args import EngineArgs
from pagoda.tune.setting import Setting, config_mapping
from pagoda.tune.trial import Slos, Trial


def _ms(value: float) -> str:
    return f"{value:.0f}" if value == value else "-"


def format_table(trials: list[Trial], start: Setting, slos: Slos, best: Trial | None) -> str:
    """One row per trial: the knobs it changed, its best level's numbers, what stopped it."""
    head = (f"{'#':>3} {'conc':>5} {'goodput':>8} {'out tok/s':>9} {'TTFT p99':>9} {'ITL p99':>8} {'binds':>6} "
            f"{'secs':>5} {'load':>5}  setting (vs the start)")
    lines = [f"trials (SLOs: TTFT p99 <= {slos.ttft_p99_ms:g} ms, ITL p99 <= {slos.itl_p99_ms:g} ms, "
             f"with {slos.headroom:.0%} headroom; goodput in requests/s; load: the 1-minute load average "
             f"at the trial's end, other work on the machine included)", head]
    for t in trials:
        mark = "*" if t is best else " "
        lv = t.best
        if t.error:
            numbers = f"{'-':>5} {'failed':>8} {'':>9} {'':>9} {'':>8} {'':>6}"
        elif lv is None:
            numbers = f"{'-':>5} {0:>8.2f} {'':>9} {'':>9} {'':>8} {t.binding(slos) or '-':>6}"
        else:
            s = lv.summary
            numbers = (f"{lv.concurrency:>5} {lv.goodput:>8.2f} {s['output_throughput']:>9.1f} "
                       f"{_ms(s['p99_ttft_ms']):>6} ms {_ms(s['p99_itl_ms']):>5} ms {t.binding(slos) or '-':>6}")
        load = t.levels[-1].summary.get("loadavg_1m") if t.levels else None
        lines.append(f"{t.index:>2}{mark} {numbers} {t.seconds:>5.0f} {load if load is not None else '-':>5}  "
                     f"{t.setting.describe(start)}"
                     + (f"  [{t.error}]" if t.error else ""))
    return "\n".join(lines)


def write_config(path: str | Path, best: Trial, base: EngineArgs, slos: Slos, workload_text: str) -> Path:
    """The best setting as a YAML file for `pagoda serve --config`, its measurements as comments."""
    import yaml  # deferred: yaml loads on first use

    lv = best.best
    s = lv.summary
    header = [f"# written by pagoda tune on {datetime.now().isoformat(timespec='seconds')}",
              f"# SLOs: TTFT p99 <= {slos.ttft_p99_ms:g} ms, ITL p99 <= {slos.itl_p99_ms:g} ms; workload: {workload_text}",
              f"# measured: {lv.goodput:.2f} requests/s ({s['output_throughput']:.1f} output tokens/s) at "
              f"{lv.concurrency} concurrent clients, TTFT p99 {s['p99_ttft_ms']:.0f} ms, ITL p99 {s['p99_itl_ms']:.0f} ms",
              "# serve with: pagoda serve --config THIS_FILE (flags on the command line win)"]
    mapping = config_mapping(best.setting.engine_args(base))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + "\n" + yaml.safe_dump(mapping, sort_keys=False))
    return out


def record(trials: list[Trial], start: Setting, best: Trial | None, slos: Slos, base: EngineArgs, extra: dict) -> dict:
    """Everything measured, as JSON-ready data (`--save-result`)."""
    def trial_json(t: Trial) -> dict:
        return {"index": t.index, "setting": t.setting.__dict__, "reason": t.reason, "seconds": t.seconds,
                "error": t.error, "goodput": t.goodput, "output_goodput": t.output_goodput,
                "binding": t.binding(slos), "best_concurrency": t.best.concurrency if t.best else None,
                "levels": [{"concurrency": lv.concurrency, "missed": lv.missed, **lv.summary} for lv in t.levels]}

    return {"date": datetime.now().isoformat(timespec="seconds"), **extra,
            "slos_ms": {"ttft_p99": slos.ttft_p99_ms, "itl_p99": slos.itl_p99_ms, "headroom": slos.headroom},
            "start": start.__dict__, "best_index": best.index if best else None,
            "best_config": config_mapping(best.setting.engine_args(base)) if best else None,
            "trials": [trial_json(t) for t in trials]}


def save_json(path: str | Path, data: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str))
    return out


def plot(trials: list[Trial], best: Trial | None, slos: Slos, path: str | Path) -> Path:
    """Two panels: each trial's goodput (the best one marked), and every measured level's p99 TTFT
    against its p99 ITL with the SLO box (a level inside the box met the SLOs)."""
    plt = _pyplot()
    fig, (ax_bar, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.6))
    xs = [t.index for t in trials]
    colors = ["tab:green" if t is best else ("tab:red" if t.error else "tab:blue") for t in trials]
    ax_bar.bar(xs, [t.goodput for t in trials], color=colors)
    ax_bar.set_xticks(xs, [str(x) for x in xs])
    ax_bar.set_xlabel("trial (green: chosen, red: failed to start)")
    ax_bar.set_ylabel("goodput (requests/s within the SLOs)")
    ax_bar.set_title("goodput per trial")
    ax_bar.grid(True, axis="y", alpha=0.3)

    for t in trials:
        for lv in t.levels:
            ax_lat.scatter(lv.summary["p99_itl_ms"], lv.summary["p99_ttft_ms"], marker="o" if lv.meets else "x",
                           color="tab:green" if t is best else ("tab:blue" if lv.meets else "tab:red"), s=28)
            ax_lat.annotate(f"{t.index}@{lv.concurrency}", (lv.summary["p99_itl_ms"], lv.summary["p99_ttft_ms"]),
                            fontsize=7, alpha=0.7, xytext=(3, 3), textcoords="offset points")
    ax_lat.axvline(slos.itl_p99_ms, color="grey", linestyle="--", linewidth=1, label="SLOs")
    ax_lat.axhline(slos.ttft_p99_ms, color="grey", linestyle="--", linewidth=1)
    if slos.headroom:
        keep = 1 - slos.headroom
        ax_lat.axvline(slos.itl_p99_ms * keep, color="grey", linestyle=":", linewidth=1, label="less the headroom")
        ax_lat.axhline(slos.ttft_p99_ms * keep, color="grey", linestyle=":", linewidth=1)
    ax_lat.set_xscale("log")
    ax_lat.set_yscale("log")
    ax_lat.set_xlabel("p99 ITL (ms)")
    ax_lat.set_ylabel("p99 TTFT (ms)")
    ax_lat.set_title("every load level (trial@concurrency; x: missed)")
    ax_lat.grid(True, which="both", alpha=0.3)
    ax_lat.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
