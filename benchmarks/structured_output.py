"""Cost of structured outputs: per-step time with and without constraints, and compile times.

    python benchmarks/structured_output.py                 # SmolLM2, batch 1 and 32
    python benchmarks/structured_output.py --batch-sizes 1,8,32 --steps 48

For each batch size, the same requests decode `--steps` tokens three ways: free, every request
under a JSON schema, every request under a regex. Constrained requests write long bounded
strings so none finishes early (each run does the same number of steps and tokens). It also
times the compilation of the test suite's 20 schemas against the real vocabulary (cold, then
cached) and whether a compiling grammar stalls free requests (it runs on a worker thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from constraint_sets import JSON_SCHEMAS  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.sampling_params import RequestOutputKind, StructuredOutputsParams as SO  # noqa: E402
from pagoda.structured_output import apply_token_bitmask, build_grammar, build_token_bitmask  # noqa: E402

# Long enough that no request completes its grammar within the measured steps.
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 600}},
          "required": ["story"]}
REGEX = r"[a-z ]{400,600}\."


def step_times(llm: LLM, batch: int, steps: int, so: SO | None) -> tuple[list[float], list[float]]:
    engine = llm.engine
    for i in range(batch):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=steps + 1, ignore_eos=True, structured_outputs=so,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"{so and so.kind}-{batch}-{i}", {"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(32)]}, params)
    while engine.core.scheduler.num_waiting or engine.core._compiling:  # admit everyone (prefill) first
        engine.step()
    times, mask_times = [], []
    vocab = llm.engine.core.model.config.vocab_size
    logits = torch.zeros(batch, vocab)
    while engine.has_unfinished_requests():
        running = list(engine.core.scheduler.running)
        if so is not None and running:  # the mask work of this step, timed on its own (it mutates nothing)
            start = time.perf_counter()
            bitmask, rows = build_token_bitmask(running, vocab)
            apply_token_bitmask(logits[: len(running)], bitmask, rows)
            mask_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[2:-1], mask_times[2:-1]  # drop warm-up and the final step


def compile_times(llm: LLM) -> dict:
    manager = llm.engine.core.structured_outputs
    manager.compiler.clear_cache()
    cold = []
    for schema in JSON_SCHEMAS:
        start = time.perf_counter()
        manager.compiler.compile_grammar(build_grammar(SO(json=schema)))
        cold.append(time.perf_counter() - start)
    return {"schemas": len(cold), "cold_ms_mean": 1e3 * statistics.mean(cold), "cold_ms_max": 1e3 * max(cold)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    llm = LLM(model=args.model, kv_cache_memory=0.5)
    results = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "runs": []}
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for label, so in (("free", None), ("json_schema", SO(json=SCHEMA)), ("regex", SO(regex=REGEX)), ("free", None)):
            times, mask_times = step_times(llm, batch, args.steps, so)
            row = {"batch": batch, "constraint": label, "step_ms_mean": 1e3 * statistics.mean(times),
                   "step_ms_p50": 1e3 * statistics.median(times),
                   "mask_ms_mean": 1e3 * statistics.mean(mask_times) if mask_times else 0.0}
            results["runs"].append(row)
            print(json.dumps(row))
    results["compile"] = compile_times(llm)
    print(json.dumps(results["compile"]))
    out = Path(args.output or Path(__file__).parent / "results" / f"structured-output-{results['date']}.json")
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
