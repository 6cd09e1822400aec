"""Offline throughput: pagoda vs transformers `generate` on the same model, dtype and prompts.

    python benchmarks/throughput.py --num-prompts 64 --output-len 128

Prompts are random token ids (fixed seed) with lengths drawn uniformly from
[input-len/2, 3*input-len/2], and every request generates exactly --output-len tokens
(ignore_eos), so all systems do the same work. transformers runs at batch 1 (on a subset of the
prompts, since its tokens/s does not depend on how many it runs one after another) and as
left-padded static batches. Results print as a table and go to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = max(1, input_len // 2), input_len * 3 // 2
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_pagoda(args, prompts) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"system": "pagoda", "requests": len(prompts), "generated_tokens": generated, "seconds": elapsed,
            "output_tokens_per_s": generated / elapsed, "steps": llm.engine.core.num_steps,
            "dtype": str(llm.engine.config.model.dtype), "_llm": llm}


def load_transformers_model(llm, dtype: torch.dtype):
    """transformers' own Llama/Qwen model on exactly the weights pagoda loaded."""
    import transformers

    files = llm.engine.config.model.files
    config = transformers.AutoConfig.from_pretrained(files.metadata_dir)
    if files.gguf_file is not None:
        from pagoda.loader.gguf import iter_gguf_weights

        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(dict(iter_gguf_weights(files.gguf_file, files.hf_config())), strict=False)
        model.tie_weights()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(files.metadata_dir, dtype=torch.float32)
    return model.to(dtype).eval()


@torch.inference_mode()
def run_hf_batch(model, prompts, output_len: int, batch_size: int, pad_id: int) -> dict:
    generated, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(batch):  # left padding, as generate expects for decoder-only models
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False, pad_token_id=pad_id)
        generated += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - start
    return {"system": f"transformers batch {batch_size}", "requests": len(prompts), "generated_tokens": generated,
            "seconds": elapsed, "output_tokens_per_s": generated / elapsed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--hf-batch1-prompts", type=int, default=4, help="prompts run by transformers at batch 1")
    ap.add_argument("--hf-batch-sizes", default="16,64", help="padded static batch sizes for transformers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="JSON path (default: benchmarks/results/throughput-<date>.json)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    from pagoda.config import EngineArgs

    results = []
    vocab = EngineArgs(model=args.model).create_engine_config().model.hf_config["vocab_size"]
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    pagoda_result = run_pagoda(args, prompts)
    llm = pagoda_result.pop("_llm")
    results.append(pagoda_result)
    print(f"pagoda: {pagoda_result['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)

    model = load_transformers_model(llm, llm.engine.config.model.dtype)
    del llm
    pad_id = 0
    r = run_hf_batch(model, prompts[: args.hf_batch1_prompts], args.output_len, 1, pad_id)
    results.append(r)
    print(f"{r['system']}: {r['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    for bs in [int(x) for x in args.hf_batch_sizes.split(",") if x]:
        r = run_hf_batch(model, prompts, args.output_len, bs, pad_id)
        results.append(r)
        print(f"{r['system']}: {r['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)

    base = results[1]["output_tokens_per_s"]
    print(f"\n{'system':<24} {'requests':>8} {'gen tokens':>10} {'seconds':>9} {'tok/s':>8} {'vs HF b1':>9}")
    for r in results:
        r["ratio_vs_hf_batch1"] = r["output_tokens_per_s"] / base
        print(f"{r['system']:<24} {r['requests']:>8} {r['generated_tokens']:>10} {r['seconds']:>9.1f} "
              f"{r['output_tokens_per_s']:>8.1f} {r['ratio_vs_hf_batch1']:>8.1f}x")
    record = {
        "date": date.today().isoformat(), "command": " ".join(sys.argv), "args": vars(args),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "pagoda_input_len_mean": statistics.mean(len(p) for p in prompts),
        "results": results,
    }
    save = Path(args.save) if args.save else Path(__file__).parent / "results" / f"throughput-{date.today().isoformat()}.json"
    save.parent.mkdir(parents=True, exist_ok=True)
    save.write_text(json.dumps(record, indent=2))
    print(f"\nsaved {save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
