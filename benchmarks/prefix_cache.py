"""Prefix caching: the same workloads with and without the cache, in one run.

    python benchmarks/prefix_cache.py
    python benchmarks/prefix_cache.py --with-cache-only --quantization gguf   # one arm, the model's GGUF blocks

1. Shared system prompt: 64 requests with one ~1,000-token system prompt and short distinct
   questions, all submitted at once; time to first token (p50 / p99) and total time.
2. Multi-turn chat: 4 conversations of 5 turns (each turn resends the whole history through the
   chat template); prompt tokens the engine had to compute, per turn and in total.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import RequestOutputKind

SYSTEM = ("You are the help desk of a public library. " + " ".join(
    f"Rule {i}: be polite, cite the catalogue number of every book you mention, and never reveal a patron's loans."
    for i in range(1, 45)))
QUESTIONS = [f"Question {i}: can I borrow book number {100 + 7 * i} for {i % 5 + 1} weeks?" for i in range(64)]


def shared_prompt(llm: LLM) -> dict:
    engine = llm.engine
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    prompts = [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS]
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = 0
    while done < len(prompts):
        for out in engine.step():
            first_token.setdefault(out.request_id, time.perf_counter() - start)
            done += out.finished
    total = time.perf_counter() - start
    ttft = sorted(first_token.values())
    return {"requests": len(prompts), "prompt_tokens_each": statistics.mean(len(p) for p in prompts),
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "total_s": total, "prefix_hit_tokens": engine.stats()["prefix_cache_hit_tokens"]}


def multi_turn(llm: LLM) -> dict:
    params = SamplingParams(temperature=0, max_tokens=24)
    computed_per_turn = [0] * 5
    prompt_per_turn = [0] * 5
    for c in range(4):
        messages = [{"role": "system", "content": "You are a concise assistant."}]
        for turn in range(5):
            messages.append({"role": "user", "content": f"Conversation {c}, turn {turn}: tell me one fact about the number {c * 10 + turn}."})
            out = llm.chat(messages, params, use_tqdm=False)[0]
            prompt_per_turn[turn] += len(out.prompt_token_ids)
            computed_per_turn[turn] += len(out.prompt_token_ids) - out.num_cached_tokens
            messages.append({"role": "assistant", "content": out.outputs[0].text})
    return {"prompt_tokens_per_turn": prompt_per_turn, "computed_prompt_tokens_per_turn": computed_per_turn,
            "prompt_tokens": sum(prompt_per_turn), "computed_prompt_tokens": sum(computed_per_turn)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--with-cache-only", action="store_true", help="skip the (slow) run without the cache")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="float32", help="float32 (the default here, exact) or auto / bfloat16")
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    results = {}
    for caching in (True,) if args.with_cache_only else (True, False):
        llm = LLM(model="smollm2-135m-instruct", kv_cache_memory=2, enable_prefix_caching=caching,
                  quantization=args.quantization, dtype=args.dtype)
        name = "with cache" if caching else "without cache"
        results[name] = {"shared_prompt": shared_prompt(llm), "multi_turn": multi_turn(llm)}
        print(name, json.dumps(results[name]), file=sys.stderr)
        del llm
    out = Path(args.save) if args.save else Path(__file__).parent / "results" / f"prefix-cache-{date.today().isoformat()}.json"
    out.write_text(json.dumps({"date": date.today().isoformat(), "command": " ".join(sys.argv), "results": results}, indent=2))
    print(f"saved {out}")
    if args.with_cache_only:
        return 0
    w, wo = results["with cache"], results["without cache"]
    print(f"\nshared ~{w['shared_prompt']['prompt_tokens_each']:.0f}-token prompt, 64 requests:")
    for k in ("ttft_p50_s", "ttft_p99_s", "total_s"):
        print(f"  {k:<12} with cache {w['shared_prompt'][k]:7.2f}   without {wo['shared_prompt'][k]:7.2f}   "
              f"ratio {wo['shared_prompt'][k] / w['shared_prompt'][k]:.1f}x")
    print("5-turn chats, prompt tokens computed:")
    print(f"  with cache {w['multi_turn']['computed_prompt_tokens']}   without {wo['multi_turn']['computed_prompt_tokens']}   "
          f"(per turn with cache: {w['multi_turn']['computed_prompt_tokens_per_turn']}, "
          f"without: {wo['multi_turn']['computed_prompt_tokens_per_turn']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
