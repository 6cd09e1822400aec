"""Reactive against predictive autoscaling, replayed through a simulator of replicas (issue 42 item 4).

A three-day trace (a diurnal load with a scheduled burst every morning, and on the last day an
unscheduled one) is replayed in 5-second steps against a fleet of simulated `pagoda serve`
replicas behind the router. Both scalers are the HPA's loop (every 15 s, scale up at once, scale
down only to the highest desired count of the last 300 s) and differ only in what they ask for:

- reactive: the replicas the request rate of the last closed minute needs (what an HPA on the
  load seen now does);
- predictive: `pagoda:desired_replicas`, from the router's own `LoadForecaster`
  (pagoda/router/forecast.py) fed the same minute counts: the larger of that and the Holt-Winters
  forecast up to the lead time (start-up + warm-up).

A replica asked for is ready `--startup` seconds later (pod scheduling, `pagoda pull`, the kernel
build, the model load), then takes traffic through the router's warm-up ramp
(pagoda.router.workers.MIN_WEIGHT to 1 over `--warmup` seconds), its share of capacity growing with
it. A replica serves `--capacity` requests/s within the SLOs: by default 2.92, the goodput
`pagoda tune` measured for SmolLM2-135M at TTFT p99 <= 2 s and ITL p99 <= 150 ms on 2 Xeon cores
(benchmarks/README.md, "Tuning SmolLM2", "Again on a quiet machine", trial 7).

Both scalers aim at `--target` (0.8) of that capacity, as an HPA's target value does. Requests
beyond the ready replicas' goodput queue (a fluid backlog); a request is an SLO violation when the
backlog it joins takes longer than the TTFT SLO (2 s) to clear at the ready capacity. Scored on
the last day (the first day fills the forecaster's season, the second lets it settle).

    python benchmarks/autoscaling.py --plot benchmarks/autoscaling.png \
        --save benchmarks/results/autoscaling-2026-12-06.json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field

import numpy as np

from pagoda.router.forecast import ForecastConfig, LoadForecaster, replicas_for
from pagoda.router.workers import MIN_WEIGHT

DAY = 86_400.0
STEP = 5.0  # seconds per simulation step
SYNC = 15.0  # the HPA's sync period
STABILIZATION = 300.0  # the HPA's default scale-down stabilization window
TTFT_SLO = 2.0  # seconds: the SLO the capacity was measured under


def trace_rate(t: float, days: int) -> float:
    """Requests/s at time t: a working-day bump (07:00-21:00, peak 20 req/s at 14:00) over a
    night floor of 1.5, a scheduled job's burst every day at 09:00 (+12 req/s for 20 minutes,
    2-minute ramps), and on the last day an unscheduled burst at 16:30 (+10 req/s, 15 minutes)."""
    hour = (t % DAY) / 3600
    rate = 1.5 + (18.5 * math.sin(math.pi * (hour - 7) / 14) ** 2 if 7 <= hour <= 21 else 0.0)
    rate += 12 * _plateau(hour * 60, 9 * 60, 20, 2)
    if t >= (days - 1) * DAY:
        rate += 10 * _plateau(hour * 60, 16.5 * 60, 15, 2)
    return rate


def _plateau(minute: float, start: float, length: float, ramp: float) -> float:
    """0 outside [start, start + length], 1 inside, linear ramps of `ramp` minutes at both ends."""
    if minute < start or minute > start + length:
        return 0.0
    return min(1.0, (minute - start) / ramp, (start + length - minute) / ramp)


@dataclass
class Fleet:
    """Replicas asked for, each with the time it became (or becomes) ready."""

    startup: float
    warmup: float
    ready_at: list[float] = field(default_factory=list)

    def scale_to(self, n: int, now: float) -> None:
        while len(self.ready_at) < n:
            self.ready_at.append(now + self.startup)
        if len(self.ready_at) > n:  # the newest go first (the ones still starting, then the least warm)
            self.ready_at = sorted(self.ready_at)[:n]

    def weight(self, now: float) -> float:
        """Ready replicas, each counted by its share in the router's warm-up ramp."""
        total = 0.0
        for ready in self.ready_at:
            if now >= ready:
                ramp = (now - ready) / self.warmup if self.warmup > 0 else 1.0
                total += min(1.0, max(MIN_WEIGHT, ramp))
        return total


def simulate(args: argparse.Namespace, predictive: bool, arrivals: np.ndarray) -> dict:
    """Replay `arrivals` (requests per step) with one scaler; the last day's score and the series."""
    clock = [0.0]
    config = ForecastConfig(interval=60.0, season=DAY, lead=args.startup + args.warmup,
                            replica_capacity=args.capacity * args.target, min_replicas=1, max_replicas=args.max_replicas)
    forecaster = LoadForecaster(config, clock=lambda: clock[0])
    fleet = Fleet(args.startup, args.warmup)
    fleet.scale_to(2, -args.startup - args.warmup)  # two warm replicas at the start
    wanted: list[tuple[float, int]] = []  # (time, desired) within the stabilization window
    backlog, scored_from = 0.0, (args.days - 1) * DAY
    score = {"requests": 0.0, "violations": 0.0, "replica_minutes": 0.0}
    series: dict[str, list[float]] = {"t": [], "rate": [], "capacity": [], "replicas": []}
    for i, arrived in enumerate(arrivals):
        now = clock[0] = i * STEP
        if i % int(SYNC / STEP) == 0:
            desired = forecaster.desired_replicas() if predictive else \
                max(1, replicas_for(forecaster.last_request_rate, args.capacity * args.target))
            wanted = [(t, d) for t, d in wanted if now - t < STABILIZATION] + [(now, desired)]
            fleet.scale_to(min(args.max_replicas, max(d for _, d in wanted)), now)
        forecaster.observe(n=int(arrived))
        capacity = fleet.weight(now) * args.capacity  # requests/s within the SLOs
        offered = backlog + arrived
        backlog = max(0.0, offered - capacity * STEP)
        over = (backlog / capacity if capacity else math.inf) > TTFT_SLO  # its wait past the TTFT SLO
        if now >= scored_from:
            score["requests"] += arrived
            score["violations"] += arrived if over else 0.0
            score["replica_minutes"] += len(fleet.ready_at) * STEP / 60
        if i % 12 == 0:
            for key, value in (("t", now), ("rate", arrived / STEP), ("capacity", capacity),
                               ("replicas", len(fleet.ready_at))):
                series[key].append(value)
    score["violation_rate"] = score["violations"] / max(1.0, score["requests"])
    return {"score": score, "series": series}


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    steps = int(args.days * DAY / STEP)
    arrivals = rng.poisson([trace_rate(i * STEP, args.days) * STEP for i in range(steps)])
    return {"settings": {k: v for k, v in vars(args).items() if k not in ("plot", "save")},
            "reactive": simulate(args, False, arrivals), "predictive": simulate(args, True, arrivals)}


def table(results: dict) -> str:
    lines = ["| scaler | requests (day 3) | SLO violations | violation rate | replica-minutes |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name in ("reactive", "predictive"):
        s = results[name]["score"]
        lines.append(f"| {name} | {s['requests']:,.0f} | {s['violations']:,.0f} | {100 * s['violation_rate']:.2f} % "
                     f"| {s['replica_minutes']:,.0f} |")
    return "\n".join(lines)


def plot(results: dict, path: str, days: int) -> None:
    import matplotlib  # deferred: only with --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for name, color in (("reactive", "tab:red"), ("predictive", "tab:blue")):
        s = results[name]["series"]
        hours = np.array(s["t"]) / 3600
        keep = hours >= (days - 1) * 24
        if name == "reactive":
            top.plot(hours[keep], np.array(s["rate"])[keep], color="0.55", lw=0.7, label="offered load (req/s)")
        top.plot(hours[keep], np.array(s["capacity"])[keep], color=color, lw=1.2,
                 label=f"{name}: ready capacity (req/s)")
        bottom.step(hours[keep], np.array(s["replicas"])[keep], color=color, lw=1.2, where="post",
                    label=f"{name}: replicas asked for")
    top.set_ylabel("requests/s")
    top.legend(loc="upper left", fontsize=8)
    bottom.set_ylabel("replicas")
    bottom.set_xlabel("hour of the run (the scored last day)")
    bottom.legend(loc="upper left", fontsize=8)
    fig.suptitle("Reactive vs predictive (Holt-Winters) autoscaling, simulated replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--days", type=int, default=3)
    p.add_argument("--startup", type=float, default=120.0,
                   help="seconds from a replica asked for to ready (pull ~20 s, kernel build ~90 s, load ~4 s)")
    p.add_argument("--warmup", type=float, default=30.0, help="the router's --warmup-seconds")
    p.add_argument("--capacity", type=float, default=2.92, help="requests/s one replica serves within the SLOs")
    p.add_argument("--target", type=float, default=0.8,
                   help="the utilization both scalers aim at (an HPA's target: desired = rate / (capacity x this))")
    p.add_argument("--max-replicas", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the last day's load, capacity and replicas here (PNG)")
    p.add_argument("--save", default=None, help="write the settings and scores here (JSON)")
    args = p.parse_args()
    results = run(args)
    print(table(results))
    if args.plot:
        plot(results, args.plot, args.days)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({k: v if k == "settings" else v["score"] for k, v in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
