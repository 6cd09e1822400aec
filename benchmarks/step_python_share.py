"""How much of a batch-64 decode step is Python: issue 13's "Python time per step under 2 %".

    python benchmarks/step_python_share.py                     # gguf and fp32, writes results/step-python-share-<date>.json
    python benchmarks/step_python_share.py --profile gguf      # and a cProfile of the steps' Python, top 40

In process, through ``LLMEngine.step`` (the loop ``LLM.generate`` runs): SmolLM2-135M-Instruct (``--model``
another, e.g. ``--model 1b-Q4_K_M.gguf --modes gguf``),
``--batch`` requests of 128 prompt tokens decoding greedily, ``--steps`` decode steps after the
prefill, each request's output handed out as deltas (what the server's streams take; CUMULATIVE
would rebuild every request's whole text and token list each step, which no caller asks for). Timers (``time.perf_counter``, wrapped around the engine's own objects) split each step:

- model: the model's forward (the C++ decoder stack / torch ops), ``compute_logits`` (the head's
  GEMM) and the sampler (argmax / softmax over the vocabulary): torch and C++ time;
- Python: the rest of ``LLMEngine.step``: the scheduler (``schedule``, ``update``), the runner's
  input preparation and output gathering, the output processor (detokenization, ``RequestOutput``s),
  the step recorder. Each of those is timed too.

The share is Python / step, from the sums over all measured steps; beside it the median step's
Python against the median step (a step that a garbage collection or the OS interrupted weighs on
the mean alone) and the 90th percentile. Every mode runs in its own process, one after another.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's pagoda, not an installed one
MODES = {"gguf": "gguf", "fp32": None}  # label -> --quantization
PROMPT_LEN = 128
DEFAULT_MODEL = "smollm2-135m-instruct"


class Timers:
    """Wraps callables so that each call's wall time is added to a named bucket."""

    def __init__(self) -> None:
        self.profiler: cProfile.Profile | None = None  # paused inside the model's buckets
        self.totals: dict[str, float] = defaultdict(float)
        self.per_step: dict[str, list[float]] = defaultdict(list)
        self._step: dict[str, float] = defaultdict(float)

    def wrap(self, owner: object, name: str, bucket: str, model: bool = False) -> None:
        """``model``: the bucket is torch / C++ time, left out of the profile of the Python."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            pause = model and self.profiler is not None
            if pause:
                self.profiler.disable()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._step[bucket] += time.perf_counter() - start
                if pause:
                    self.profiler.enable()

        setattr(owner, name, timed)

    def end_step(self, keep: bool) -> None:
        if keep:
            for bucket, seconds in self._step.items():
                self.totals[bucket] += seconds
                self.per_step[bucket].append(seconds)
        self._step = defaultdict(float)


class GarbageCollections:
    """Counts the collector's runs (a ``gc.callbacks`` entry) and their wall time, per generation."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def summary(self) -> dict:
        return {f"gen{g}": {"count": self.count[g], "ms": round(1e3 * self.seconds[g], 3)} for g in range(3)}


def measure(model: str, quantization: str | None, batch: int, steps: int, profile: bool) -> dict:
    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.sampling_params import RequestOutputKind

    llm = LLM(model=model, kv_cache_memory=1.0, quantization=quantization)
    engine = llm.engine
    core = engine.core
    runner = core.runner
    timers = Timers()
    timers.wrap(runner, "forward", "model forward", model=True)
    timers.wrap(runner.model, "compute_logits", "head (logits)", model=True)
    timers.wrap(runner, "sampler", "sampler", model=True)
    timers.wrap(core.scheduler, "schedule", "scheduler.schedule")
    timers.wrap(core.scheduler, "update", "scheduler.update")
    timers.wrap(core.executor, "execute_model", "runner.execute")
    timers.wrap(engine.output_processor, "process_outputs", "output processor")
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(PROMPT_LEN)]},
                           SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True,
                                          output_kind=RequestOutputKind.DELTA))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        engine.step()  # the prefill
        timers.end_step(keep=False)
    engine.step()  # one decode step to warm up
    timers.end_step(keep=False)
    profiler = timers.profiler = cProfile.Profile() if profile else None
    collections = GarbageCollections()
    gc.callbacks.append(collections.observe)
    step_times = []
    for _ in range(steps):
        if len(core.scheduler.running) != batch:
            break
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        engine.step()
        if profiler:
            profiler.disable()
        step_times.append(time.perf_counter() - start)
        timers.end_step(keep=True)
    gc.callbacks.remove(collections.observe)
    engine_step = sum(step_times)
    model = sum(timers.totals[b] for b in ("model forward", "head (logits)", "sampler"))
    python = engine_step - model
    model_steps = [sum(timers.per_step[b][i] for b in ("model forward", "head (logits)", "sampler"))
                   for i in range(len(step_times))]
    python_steps = sorted(step - model_step for step, model_step in zip(step_times, model_steps))
    parts = {bucket: 1e3 * seconds / len(step_times) for bucket, seconds in timers.totals.items()}
    runner_python = timers.totals["runner.execute"] - model
    parts["runner, outside the model"] = 1e3 * runner_python / len(step_times)
    rest = python - runner_python - sum(timers.totals[b] for b in
                                         ("scheduler.schedule", "scheduler.update", "output processor"))
    parts["engine core and recorder (the rest)"] = 1e3 * rest / len(step_times)
    result = {
        "batch": batch, "steps": len(step_times), "threads": torch.get_num_threads(),
        "step_ms_mean": 1e3 * engine_step / len(step_times), "step_ms_median": 1e3 * statistics.median(step_times),
        "model_ms_mean": 1e3 * model / len(step_times), "python_ms_mean": 1e3 * python / len(step_times),
        "python_share": python / engine_step, "parts_ms_mean": parts,
        # per step: a step that a collection or the OS interrupted weighs on the mean alone
        "python_ms_median": 1e3 * statistics.median(python_steps),
        "python_ms_p90": 1e3 * python_steps[int(0.9 * (len(python_steps) - 1))],
        "python_ms_top3": [1e3 * t for t in python_steps[-3:]],
        "python_share_median_step": statistics.median(python_steps) / statistics.median(step_times),
        "gc_collections": collections.summary(),
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(40)
        result["profile_top"] = text.getvalue()
    llm.shutdown()
    return result


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c", "amx")))
    except OSError:
        pass
    return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="gguf,fp32", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--model", default=DEFAULT_MODEL, help="a catalog name or a path (e.g. a GGUF file)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--profile", default="", help="modes to cProfile (the profile's own cost inflates Python)")
    p.add_argument("--label", default="", help="appended to the result file's name")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one mode, print JSON
    ns = p.parse_args()
    if ns.one:
        print(json.dumps(measure(ns.model, MODES[ns.one], ns.batch, ns.steps, ns.one in ns.profile.split(","))))
        return 0
    rows = []
    for mode in ns.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode, "--model", ns.model, "--batch", str(ns.batch),
               "--steps", str(ns.steps), "--profile", ns.profile]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, env=os.environ)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        row = {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}
        rows.append(row)
        print(f"{mode}: step {row['step_ms_mean']:.1f} ms, model {row['model_ms_mean']:.1f} ms, "
              f"Python {row['python_ms_mean']:.2f} ms = {100 * row['python_share']:.2f} % "
              f"(per step: median {row['python_ms_median']:.2f} ms = {100 * row['python_share_median_step']:.2f} %, "
              f"p90 {row['python_ms_p90']:.2f} ms)")
        print("    collections in the measured steps: " + ", ".join(
            f"{gen} {c['count']} ({c['ms']:.1f} ms)" for gen, c in row["gc_collections"].items()))
        for part, ms in row["parts_ms_mean"].items():
            print(f"    {part:40s} {ms:8.2f} ms")
        if "profile_top" in row:
            print(row["profile_top"])
    out = ns.out or HERE / "results" / f"step-python-share-{date.today()}{'-' + ns.label if ns.label else ''}.json"
    out.write_text(json.dumps({
        "date": str(date.today()), "command": " ".join(["python", "benchmarks/step_python_share.py", *sys.argv[1:]]),
        "cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
        "load_average": os.getloadavg(), "rows": rows,
    }, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
