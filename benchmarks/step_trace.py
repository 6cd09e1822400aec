"""What the engine's recorder (pagoda/engine/step_trace.py, behind /v1/debug and the dashboard) costs.

    python benchmarks/step_trace.py      # writes results/step-trace-<date>.json

1. The hooks alone: `begin_step` + `end_step` per step for batches of 1, 16, 64 and 256 decode
   rows (real `Request`s, a `SchedulerOutput` as the scheduler builds it), plus one arrival and one
   finish per step (a busy server); microseconds per step.
2. In the engine, worst case: the tiny random Llama (tests/tiny_models.py), whose steps cost
   well under a millisecond, so the recorder's share is as large as it gets: 64 requests of 128
   tokens through `LLM.generate`, with the recorder and with a no-op stand-in, alternated
   `--repeats` times; the median steps per second of each.
3. The snapshots: building `all` (what the dashboard asks for, 4 times a second) after that run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))


def hooks_alone(batch: int, steps: int = 2000) -> float:
    from pagoda.core.scheduler_output import SchedulerOutput
    from pagoda.engine.step_trace import StepTrace
    from pagoda.request import Request
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=10)
    requests = {}
    for i in range(batch):
        r = Request(str(i), list(range(100)), params)
        r.output_token_ids.append(1)
        r.all_token_ids.append(1)
        r.num_computed_tokens = r.num_tokens - 1
        requests[r.request_id] = r
    sched = SchedulerOutput(num_scheduled_tokens={rid: 1 for rid in requests})
    trace = StepTrace()
    extra = Request("x", list(range(100)), params)
    start = time.perf_counter()
    for _ in range(steps):
        trace.arrived(extra)
        trace.begin_step(sched, requests)
        trace.end_step(sched, batch, batch, 0, 0.5)
        trace.finished(extra, "length")
    return (time.perf_counter() - start) / steps * 1e6


class NullTrace:
    """The recorder's hooks doing nothing."""

    def arrived(self, *_): pass
    def begin_step(self, *_): pass
    def end_step(self, *_): pass
    def finished(self, *_): pass


def engine_steps_per_second(llm, trace, prompts, params) -> float:
    core = llm.engine.core
    core.trace = trace
    before = core.num_steps
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (core.num_steps - before) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tiny_models import make_tiny_hf_model

    from pagoda import LLM, SamplingParams
    from pagoda.engine.step_trace import StepTrace
    import tempfile

    result = {"hooks_us_per_step": {b: round(hooks_alone(b), 2) for b in (1, 16, 64, 256)}}
    print("hooks alone, µs per step:", result["hooks_us_per_step"])
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_hf_model("llama", Path(tmp) / "llama", seed=0)
        llm = LLM(model=str(model), dtype="float32", kv_cache_memory=0.05)
        prompts = [f"Request {i}: once upon a time" for i in range(64)]
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        engine_steps_per_second(llm, StepTrace(), prompts, params)  # warm up
        runs = {"recorder": [], "none": []}
        for i in range(args.repeats):
            for name in (("recorder", "none") if i % 2 == 0 else ("none", "recorder")):
                runs[name].append(engine_steps_per_second(llm, StepTrace() if name == "recorder" else NullTrace(),
                                                          prompts, params))
        trace = llm.engine.core.trace = StepTrace()
        engine_steps_per_second(llm, trace, prompts, params)
        start = time.perf_counter()
        for _ in range(20):
            snapshot = llm.engine.core.debug_snapshot("all")
        snapshot_ms = (time.perf_counter() - start) / 20 * 1000
    result["engine_steps_per_s"] = {name: [round(v, 1) for v in values] for name, values in runs.items()}
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result["median_steps_per_s"] = {name: round(v, 1) for name, v in medians.items()}
    result["recorder_over_none"] = round(medians["recorder"] / medians["none"], 3)
    result["snapshot_all_ms"] = round(snapshot_ms, 2)
    result["snapshot_all_bytes"] = len(json.dumps(snapshot))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    result["cpu"] = cpu
    result["cpu_flags"] = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    result["command"] = "python benchmarks/step_trace.py " + " ".join(sys.argv[1:])
    print(json.dumps(result, indent=1))
    out = HERE / "results" / f"step-trace-{date.today()}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
