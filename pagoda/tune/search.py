"""The search: which settings to try, in what order, within a budget of trials or seconds.

The full grid is the product of every knob's values (4 quantizations x 2 thread counts x 2 dtypes x
2 speculative modes x 7 token budgets x ~10 batch sizes: over 2,000 server runs); vLLM's
`benchmarks/auto_tune` runs its whole grid of max-num-seqs x max-num-batched-tokens, each with a
request-rate search. This search uses what is known about each knob instead:

1. **The start** (the flags given, by default the engine's defaults) is measured first.
2. **Coordinate descent over the discrete knobs** (quantization, num-threads, dtype, speculative
   decoding): each other value is tried with the best setting so far, and kept when its goodput is
   higher by more than `min_gain` (noise on a shared machine is a few percent). These knobs change
   how fast a step runs, mostly independently of each other, so one pass costs the sum of their
   values, not the product.
3. **max-num-batched-tokens, a line search in the direction the binding SLO asks for**: a big
   budget prefills long chunks in one step (TTFT falls) and stalls the running decodes for that
   step (ITL rises). So when the best setting first misses on ITL the budget is halved, when on
   TTFT doubled, while goodput improves.
4. **max-num-seqs, a bisection for the SLO boundary**: ITL grows with the batch, monotonically. If
   the best setting met the SLOs at concurrency c but missed ITL at 2c, capping the batch at m in
   (c, 2c) lets 2c clients be served with a batch of m, the others queueing (TTFT pays). The
   largest m whose ITL fits is found by bisection in log2(c) trials. When TTFT is what binds, a
   cap only lengthens the queue, and the step is skipped.

Every trial's load search starts at the best concurrency found so far, so it measures two or three
levels. With the budget spent, the best trial so far is the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.tune.setting import KNOBS, Setting, candidates
from pagoda.tune.trial import Slos, Trial

MIN_BATCHED_TOKENS = 64
MAX_BATCHED_TOKENS = 8192


@dataclass
class Budget:
    """At most `trials` trials, and no trial started that would end past `seconds` (judged by the
    mean trial so far)."""

    trials: int | None = 12
    seconds: float | None = None
    started: float = field(default_factory=time.monotonic)

    def allows(self, done: list[Trial]) -> bool:
        if self.trials is not None and len(done) >= self.trials:
            return False
        if self.seconds is not None and done:
            elapsed = time.monotonic() - self.started
            mean = sum(t.seconds for t in done) / len(done)
            return elapsed + mean <= self.seconds
        return True


# (index, setting, start concurrency, reason) -> the measured trial
RunTrial = Callable[[int, Setting, int, str], Trial]


class Search:
    """Runs the steps of the module docstring; `trials` holds every trial in order."""

    def __init__(self, start: Setting, run: RunTrial, slos: Slos, budget: Budget, *, knobs: tuple[str, ...] = KNOBS,
                 model_is_gguf: bool = False, start_concurrency: int = 4, max_concurrency: int = 64,
                 min_gain: float = 0.03, auto_dtype: str = "float32", log: Callable[[str], None] = print) -> None:
        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise ValueError(f"unknown knob(s) {', '.join(unknown)}; the knobs are {', '.join(KNOBS)}")
        self.start, self.run_trial, self.slos, self.budget = start, run, slos, budget
        self.knobs, self.model_is_gguf = knobs, model_is_gguf
        self.start_concurrency, self.max_concurrency, self.min_gain = start_concurrency, max_concurrency, min_gain
        self.auto_dtype = auto_dtype  # what --dtype auto resolves to on this device
        self.log = log
        self.trials: list[Trial] = []
        self.best: Trial | None = None
        self.spent = False

    # -- steps ------------------------------------------------------------------------------------
    def run(self) -> Trial | None:
        """The search; returns the best trial that met the SLOs (None if none did)."""
        self._try(self.start, "the start")
        for knob in KNOBS[:4]:
            if knob in self.knobs:
                self._descend(knob)
        if "max-num-batched-tokens" in self.knobs:
            self._line_search_batched_tokens()
        if "max-num-seqs" in self.knobs:
            self._bisect_num_seqs()
        return self.best if self.best is not None and self.best.goodput > 0 else None

    def _descend(self, knob: str) -> None:
        current = self._best_setting().knob(knob)
        if knob == "dtype" and current == "auto":
            current = self.auto_dtype  # the same engine: not worth a trial
        for value in candidates(knob, self.model_is_gguf):
            if value != current and not self._try(self._best_setting().with_knob(knob, value), f"{knob}"):
                return

    def _line_search_batched_tokens(self) -> None:
        binding = self.best.binding(self.slos) if self.best else None
        if binding not in ("ttft", "itl"):
            self.log(f"  max-num-batched-tokens: skipped (binding: {binding or 'none, the load cap was reached'})")
            return
        step = 2 if binding == "ttft" else 0.5
        while True:
            value = int(self._best_setting().max_num_batched_tokens * step)
            if not MIN_BATCHED_TOKENS <= value <= MAX_BATCHED_TOKENS:
                return
            before = self.best
            if not self._try(self._best_setting().with_knob("max-num-batched-tokens", value),
                             f"{binding} binds: {'more' if step > 1 else 'fewer'} tokens a step"):
                return
            if self.best is before:
                return

    def _bisect_num_seqs(self) -> None:
        best = self.best
        if best is None or best.best is None or best.binding(self.slos) != "itl":
            why = "no setting met the SLOs" if best is None or best.best is None else \
                f"binding: {best.binding(self.slos) or 'none'}"
            self.log(f"  max-num-seqs: skipped ({why}; a batch cap helps only where ITL binds)")
            return
        lo, hi = best.best.concurrency, best.limit.concurrency  # batch lo fits ITL, batch hi does not
        hi = min(hi, best.setting.max_num_seqs + 1)
        while hi - lo > max(1, lo // 4):
            mid = (lo + hi) // 2
            setting = self._best_setting().with_knob("max-num-seqs", mid)
            trial = self._run(setting, f"bisect max-num-seqs in ({lo}, {hi})", start=best.limit.concurrency)
            if trial is None:
                return
            fits = trial.itl_fits_at(mid, self.slos)
            if fits:
                lo = mid
            else:
                hi = mid

    # -- bookkeeping ------------------------------------------------------------------------------
    def _best_setting(self) -> Setting:
        return self.best.setting if self.best is not None else self.start

    def _try(self, setting: Setting, reason: str) -> bool:
        """Run a trial unless one ran this setting already; False when the budget is spent."""
        if any(t.setting == setting for t in self.trials):
            return True
        return self._run(setting, reason) is not None

    def _run(self, setting: Setting, reason: str, start: int | None = None) -> Trial | None:
        if self.spent or not self.budget.allows(self.trials):
            if not self.spent:
                self.log(f"  budget spent after {len(self.trials)} trials (next would have been "
                         f"{setting.describe(self.start)})")
            self.spent = True
            return None
        if start is None:
            start = self.best.best.concurrency if self.best and self.best.best else self.start_concurrency
        index = len(self.trials) + 1
        self.log(f"trial {index}: {setting.describe(self.start)} ({reason})")
        trial = self.run_trial(index, setting, start, reason)
        self.trials.append(trial)
        if trial.error:
            self.log(f"    failed: {trial.error}")
        if self._better(trial):
            self.best = trial
        return trial

    def _better(self, trial: Trial) -> bool:
        if trial.error:
            return False
        if self.best is None:
            return True
        if self.best.goodput == 0:
            return trial.goodput > 0 or bool(trial.levels and not self.best.levels)
        return trial.goodput > self.best.goodput * (1 + self.min_gain)
