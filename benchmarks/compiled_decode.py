"""Does torch.compile pay here? Decode step time, eager vs `--compile`, side by side in one run.

    python benchmarks/compiled_decode.py --batch-sizes 1,64 --steps 24

Both runs share one engine (the compiled forward is swapped in), the same requests (32-token
prompts, greedy, `ignore_eos`) and alternate eager / compiled twice per batch size, so machine
noise hits both. Reports the median step time, the compile (warm-up) time and whether the tokens
are identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import RequestOutputKind
from pagoda.worker.compiled import compiled_forward


def decode(llm: LLM, forward, batch: int, steps: int, tag: str) -> tuple[list[float], list[list[int]]]:
    engine = llm.engine
    engine.core.runner.forward = forward
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": [1 + (i * 7 + j) % 500 for j in range(32)]},
                           SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
    times, outs = [], []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs += engine.step()
        times.append(time.perf_counter() - start)
    tokens = [o.outputs[0].token_ids for o in sorted(outs, key=lambda o: int(o.request_id.rsplit("-", 1)[1]))]
    return times[3:-1], tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    llm = LLM(model=args.model, kv_cache_memory=1.0)
    eager = llm.engine.core.model.forward
    compiled = compiled_forward(llm.engine.core.model)
    start = time.perf_counter()
    for b in (1, 3):  # trace and build the dynamic-shape graphs
        decode(llm, compiled, b, 4, f"warm{b}")
    result = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "compile_seconds": time.perf_counter() - start, "runs": []}
    print(f"compile + warm-up: {result['compile_seconds']:.1f} s")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        medians = {"eager": [], "compiled": []}
        tokens = {}
        for rep in range(2):
            for name, forward in (("eager", eager), ("compiled", compiled)):
                times, tokens[name] = decode(llm, forward, batch, args.steps, f"{name}{batch}-{rep}")
                medians[name].append(statistics.median(times))
        row = {"batch": batch, "eager_step_ms": [1e3 * m for m in medians["eager"]],
               "compiled_step_ms": [1e3 * m for m in medians["compiled"]],
               "speedup": statistics.mean(medians["eager"]) / statistics.mean(medians["compiled"]),
               "identical_tokens": tokens["eager"] == tokens["compiled"]}
        result["runs"].append(row)
        print(json.dumps(row))
    out = Path(args.output or Path(__file__).parent / "results" / f"compiled-decode-{result['date']}.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
