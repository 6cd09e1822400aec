"""Tensor parallelism on this CPU: TP=1 against TP=2, one run, side by side.

    python benchmarks/tensor_parallel.py            # writes results/tensor-parallel-<date>.json

The model is a random-weight Llama of SmolLM2-135M's size that TP=2 can split (SmolLM2 has 9
attention heads, so it takes TP=1 or 3 only): hidden 576 -> 512 with 8 heads of 64, 4 KV heads,
MLP 1536, 30 layers, vocabulary 49,152; fp32, built from a transformers config. For each TP size:

- decode step at batch 1 / 16 / 64: median wall time of a decode-only step (32-token prompts);
- on rank 0, per step (means): the model time (executor.execute_model), the scheduler (schedule +
  update) and the broadcast of the SchedulerOutput to the other ranks, and the all-reduces (count,
  time; shared memory between ranks on one machine, else gloo: ``--gloo`` forces gloo);
- offline throughput: 64 prompts of 128 tokens, 128 output tokens each, through LLM.generate.

Record the CPU flags with the results: a TP rank gets its share of the cores (here 1 of 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)


def make_model(out: Path) -> Path:
    import torch
    import transformers

    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_models import make_tokenizer

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rms_norm_eps=1e-6, **SHAPE))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    return out


class StepClock:
    """Wall time of the parts of a step on rank 0."""

    def __init__(self, core) -> None:
        self.parts: dict[str, list[float]] = {"model": [], "schedule": [], "update": [], "broadcast": [], "all_reduce": []}
        self.all_reduces = 0
        self._wrap(core.executor, "execute_model", "model")
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update", "update")
        tp = core.executor.driver_worker.tp
        if tp.is_parallel:
            self._wrap(tp, "broadcast_object", "broadcast")
            self._wrap(tp, "all_reduce", "all_reduce")

    def _wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[part].append(time.perf_counter() - start)

        setattr(obj, name, timed)

    def reset(self) -> None:
        for v in self.parts.values():
            v.clear()


def decode_steps(llm, batch: int, steps: int, clock: StepClock) -> dict:
    from pagoda import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": [(i * 7 + j) % 1000 + 10 for j in range(32)]}, params)
    while engine.core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                   for r in engine.core.scheduler.running):
        engine.step()
    clock.reset()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    per_step = {k: sum(v) / steps * 1e3 for k, v in clock.parts.items()}
    calls = len(clock.parts["all_reduce"]) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "step_ms": statistics.median(times) * 1e3,
            "per_step_ms": per_step, "all_reduces_per_step": calls,
            "overhead_pct_of_model": 100 * (per_step["schedule"] + per_step["update"] + per_step["broadcast"])
            / per_step["model"]}


def throughput(llm, n: int = 64, prompt_len: int = 128, out_len: int = 128) -> dict:
    from pagoda import SamplingParams

    prompts = [{"prompt_token_ids": [(i * 13 + j) % 5000 + 10 for j in range(prompt_len)]} for i in range(n)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"requests": n, "prompt_len": prompt_len, "output_len": out_len, "seconds": seconds,
            "output_tokens_per_s": n * out_len / seconds}


def run(tp: int, model: Path, steps: int) -> dict:
    from pagoda import LLM

    with LLM(str(model), dtype="float32", tensor_parallel_size=tp, kv_cache_memory=1.0, enable_prefix_caching=False) as llm:
        clock = StepClock(llm.engine.core)
        decode = [decode_steps(llm, b, steps, clock) for b in (1, 16, 64)]
        return {"tensor_parallel_size": tp, "decode": decode, "throughput": throughput(llm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagoda-tp-bench-model"))
    parser.add_argument("--gloo", action="store_true", help="collectives and orders through gloo, not shared memory")
    args = parser.parse_args()
    if args.gloo:
        os.environ["PAGODA_TP_SHARED_MEMORY"] = "0"  # read by every rank (worker._shared_memory_bytes)
    from pagoda.platform import cpu_flags

    model = make_model(args.model_dir)
    results = {"date": str(date.today()), "shape": SHAPE,
               "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))),
               "runs": [run(tp, model, args.steps) for tp in (1, 2)]}
    results["collectives"] = "gloo" if args.gloo else "shared memory"
    out = HERE / "results" / f"tensor-parallel-{date.today()}{'-gloo' if args.gloo else ''}.json"
    out.write_text(json.dumps(results, indent=2))
    for r in results["runs"]:
        print(f"TP={r['tensor_parallel_size']}: throughput {r['throughput']['output_tokens_per_s']:.1f} tok/s")
        for d in r["decode"]:
            p = d["per_step_ms"]
            print(f"  batch {d['batch']:>2}: step {d['step_ms']:.1f} ms (model {p['model']:.1f}, schedule+update "
                  f"{p['schedule'] + p['update']:.2f}, broadcast {p['broadcast']:.2f}, all-reduce "
                  f"{p['all_reduce']:.1f} ms in {d['all_reduces_per_step']:.0f} calls; overhead "
                  f"{d['overhead_pct_of_model']:.2f} % of the model)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
