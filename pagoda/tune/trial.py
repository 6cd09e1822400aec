"""One trial: a `pagoda serve` with one setting, loaded at rising concurrency until it misses an SLO.

The server is started as `pagoda bench` starts one (`pagoda.bench.servers.running`), and each load
level is a `pagoda bench serve` run (`pagoda.bench.serve.benchmark`): a closed loop of streaming
clients at a fixed concurrency, each request timed chunk by chunk. A level *meets the SLOs* when
every request completed and its p99 TTFT and p99 ITL are within the SLOs less the headroom. A
setting's **goodput** is the request rate of its best level that meets them (0 when none does):
the load it sustains within the SLOs (DistServe's and vLLM's definition, at a 99 % attainment).

Levels are powers of two from a starting concurrency (usually the best one found so far): up by
doubling while a level passes, down by halving while it fails, so a trial near the boundary
measures two or three levels. Beyond `--max-num-seqs` the extra clients wait in the queue: their
TTFT grows, the batch (and ITL) does not.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from pagoda.bench import datasets, serve, servers
from pagoda.engine_args import EngineArgs
from pagoda.tune.setting import Setting, command_flags


@dataclass(frozen=True)
class Slos:
    """Latency objectives in milliseconds, and the share of them a trial keeps in reserve."""

    ttft_p99_ms: float
    itl_p99_ms: float
    headroom: float = 0.1

    def misses(self, summary: dict) -> list[str]:
        """What a level missed: "errors" (a request failed), "ttft", "itl" (p99 over the SLO less headroom)."""
        missed = []
        if summary["failed"] or not summary["completed"]:
            missed.append("errors")
        if not summary["p99_ttft_ms"] <= self.ttft_p99_ms * (1 - self.headroom):
            missed.append("ttft")
        if not summary["p99_itl_ms"] <= self.itl_p99_ms * (1 - self.headroom):
            missed.append("itl")
        return missed


@dataclass
class Level:
    """One load level of a trial: its concurrency and what `pagoda bench serve` measured."""

    concurrency: int
    summary: dict
    missed: list[str]

    @property
    def meets(self) -> bool:
        return not self.missed

    @property
    def goodput(self) -> float:
        """Requests/s if the level met the SLOs, else 0."""
        return self.summary["request_throughput"] if self.meets else 0.0


@dataclass
class Trial:
    """A setting's server and the load levels measured on it."""

    index: int
    setting: Setting
    levels: list[Level] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    reason: str = ""  # why the search ran it, for the table

    @property
    def best(self) -> Level | None:
        """The level with the most goodput among those that met the SLOs."""
        passing = [lv for lv in self.levels if lv.meets]
        return max(passing, key=lambda lv: (lv.goodput, lv.summary["output_throughput"])) if passing else None

    @property
    def goodput(self) -> float:
        return self.best.goodput if self.best else 0.0

    @property
    def output_goodput(self) -> float:
        """Output tokens/s at the best level (0 when none met the SLOs)."""
        return self.best.summary["output_throughput"] if self.best else 0.0

    @property
    def limit(self) -> Level | None:
        """The lowest level that missed the SLOs above the best one (or the lowest, if none passed):
        the load where this setting stops meeting them."""
        floor = self.best.concurrency if self.best else 0
        failing = [lv for lv in self.levels if not lv.meets and lv.concurrency > floor]
        return min(failing, key=lambda lv: lv.concurrency) if failing else None

    def binding(self, slos: Slos) -> str | None:
        """Which SLO stops this setting: "ttft" or "itl" (the one further over), "errors", or None
        when every level measured met them (the load cap was reached first)."""
        limit = self.limit
        if limit is None:
            return None
        if "errors" in limit.missed:
            return "errors"
        ttft = limit.summary["p99_ttft_ms"] / slos.ttft_p99_ms
        itl = limit.summary["p99_itl_ms"] / slos.itl_p99_ms
        return "ttft" if ttft >= itl else "itl"

    def itl_fits_at(self, concurrency: int, slos: Slos) -> bool | None:
        """Whether some level at `concurrency` or above kept ITL within its SLO; None if none was measured."""
        above = [lv for lv in self.levels if lv.concurrency >= concurrency and "errors" not in lv.missed]
        if not above:
            return None
        return any("itl" not in lv.missed for lv in above)


@dataclass
class Workload:
    """What each level sends: synthetic prompts of given lengths, or a JSONL file's (the formats
    of `pagoda bench serve --dataset`), `rounds` requests per client and at least `min_requests`."""

    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    dataset: str | None = None
    seed: int = 0
    rounds: int = 2
    min_requests: int = 4
    num_prompts: int | None = None  # fixed requests per level, instead of rounds x concurrency
    tokenizer: object = None

    def count(self, concurrency: int) -> int:
        return self.num_prompts or max(self.min_requests, self.rounds * concurrency)

    def requests(self, concurrency: int) -> list[datasets.SampleRequest]:
        n = self.count(concurrency)
        if self.dataset:
            rows = datasets.load_jsonl(self.dataset, output_len=self.output_len, tokenizer=self.tokenizer, num_prompts=n)
            return [rows[i % len(rows)] for i in range(n)]  # a short file is sent round and round
        return datasets.random_requests(n, self.input_len, self.output_len, range_ratio=self.range_ratio,
                                        tokenizer=self.tokenizer, as_text=True, seed=self.seed)


def measure_level(base_url: str, workload: Workload, concurrency: int, slos: Slos, *, warmup: bool) -> Level:
    """One `pagoda bench serve` run at this concurrency."""
    cfg = serve.ServeConfig(base_url=base_url, max_concurrency=concurrency, request_rate=math.inf, seed=workload.seed)
    summary, _ = asyncio.run(serve.benchmark(cfg, workload.requests(concurrency), tokenizer=workload.tokenizer,
                                             percentiles=(50.0, 99.0), warmup=warmup))
    return Level(concurrency, summary, slos.misses(summary))


def search_load(measure, start: int, max_concurrency: int) -> list[Level]:
    """Levels at powers of two from `start`: up while they pass, down while they fail, ending at
    the boundary (a passing level next to a failing one), 1, or `max_concurrency`."""
    levels: dict[int, Level] = {}
    c = max(1, min(start, max_concurrency))
    while c not in levels:
        levels[c] = level = measure(c)
        if level.meets:
            c = min(c * 2, max_concurrency)
        else:
            c = max(c // 2, 1)
    return [levels[k] for k in sorted(levels)]


def run_trial(index: int, setting: Setting, base: EngineArgs, workload: Workload, slos: Slos, *,
              start_concurrency: int, max_concurrency: int, reason: str = "", log=print) -> Trial:
    """Start a server with `setting` over `base`, search its load levels, stop it."""
    trial = Trial(index, setting, reason=reason)
    t0 = time.perf_counter()
    port = servers.free_port()
    cmd = servers.pagoda_command(base.model, port, *command_flags(setting.engine_args(base)))
    try:
        with servers.running(cmd, port) as url:
            first = [True]

            def measure(c: int) -> Level:
                level = measure_level(url, workload, c, slos, warmup=first[0])
                first[0] = False
                s = level.summary
                log(f"    concurrency {c:>3}: {s['request_throughput']:.2f} req/s, TTFT p99 {s['p99_ttft_ms']:.0f} ms, "
                    f"ITL p99 {s['p99_itl_ms']:.0f} ms{'' if level.meets else ' - missed ' + ', '.join(level.missed)}")
                return level

            trial.levels = search_load(measure, start_concurrency, max_concurrency)
    except (RuntimeError, OSError) as e:  # the server did not start (a setting this model or machine refuses)
        trial.error = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
    trial.seconds = time.perf_counter() - t0
    return trial
