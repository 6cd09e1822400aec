"""Speculative decoding against plain decoding, side by side in one run: n-gram prompt lookup on a
workload with repetition, and a draft model (the GGUF SmolLM2 drafting for the fp32 one) on chat.

    python benchmarks/spec_decode.py                 # writes results/spec-decode-<date>.json
    python benchmarks/spec_decode.py --streams 1     # one concurrency only
    python benchmarks/spec_decode.py --repeats 5     # more alternating pairs per setting (default 3)

Target: SmolLM2-135M-Instruct fp32 (the catalog GGUF, dequantized). Greedy, 128 new tokens.
Per workload one plain and one speculative engine (default speculative_config otherwise, so the
turn-down by batch size and by measurement is on), warmed up; per concurrency, alternating runs
of each (``--repeats``), all streams at once through ``LLMEngine.add_request`` / ``step`` with
every step's new tokens timed as they come out; the prefix cache is reset before each run. The
median run of each side is reported, and the ratio of every alternating pair.

- decode tok/s: new tokens after each request's first / the time from its first token to its last
  (summed over requests at 1 stream; at N streams, all tokens / the span from the first first
  token to the last token);
- ITL: the gap between a request's successive outputs divided by the tokens that output brought
  (a run of accepted drafts arrives at once), p50 / p99 over all tokens;
- TTFT: arrival to first token, mean;
- acceptance: rate, mean accepted length (tokens per verification, the target's own included),
  per draft position, and draft / verify seconds from the engine's stats.

Plain and speculative answers must be equal (the script asserts it).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
MODEL = "smollm2-135m-instruct"
PARAGRAPH = ("The paged KV cache stores keys and values in fixed-size blocks. A block table maps each "
             "sequence to its blocks, so memory is allocated on demand and shared between requests "
             "that start with the same prompt.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
REPETITION = [f"Repeat this text exactly:\n\n{PARAGRAPH}", f"Copy this code and add a docstring to each function:\n\n{CODE}",
              f"Rewrite this text, replacing 'blocks' with 'pages':\n\n{PARAGRAPH}", f"Quote this code back:\n\n{CODE}"]
CHAT = ["Write a short story about a robot learning to paint.", "Explain how a hash table works.",
        "What are the benefits of regular exercise?", "Give me three tips for learning a new language.",
        "Describe the water cycle for a ten-year-old.", "Why is the sky blue?",
        "Summarize the plot of a heist movie you invent.", "How do I make a good cup of coffee?"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
DRAFT = {"method": "draft_model", "model": MODEL, "quantization": "gguf", "num_speculative_tokens": 4}


def engine(spec: dict | None):
    from pagoda import LLM, SamplingParams

    llm = LLM(MODEL, dtype="float32", kv_cache_memory=0.5, speculative_config=spec)
    tokenizer = llm.get_tokenizer()
    warm = tokenizer.encode("Tell me about the weather in spring and in autumn. " * 6)  # a prefill and decode steps
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    return llm


def run(llm, spec: dict | None, prompts: list[str], streams: int, max_tokens: int = 128) -> dict:
    """All streams at once through the engine's step loop, every step's new tokens timed. The
    prefix cache is reset first, so that every repetition prefills its prompts."""
    from pagoda import SamplingParams

    engine = llm.engine
    engine.core.kv_manager.reset_prefix_cache()
    tokenizer = llm.get_tokenizer()
    chats = [tokenizer.encode_chat([{"role": "user", "content": prompts[i % len(prompts)]}]) for i in range(streams)]
    before = engine.stats()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    arrival, seen, times, tokens = {}, {}, {}, {}
    for i, prompt in enumerate(chats):
        rid = f"{time.monotonic_ns()}-{i}"
        arrival[rid] = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        seen[rid], times[rid], tokens[rid] = 0, [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            ids = out.outputs[0].token_ids
            if len(ids) > seen[out.request_id]:
                times[out.request_id].append((now, len(ids) - seen[out.request_id]))
                seen[out.request_id] = len(ids)
                tokens[out.request_id] = list(ids)
    return _figures(spec, streams, arrival, times, tokens, before, engine.stats())


def _figures(spec, streams, arrival, times, tokens, before, stats) -> dict:
    ttft = [times[r][0][0] - arrival[r] for r in arrival]
    itl = []
    for r in times:
        for (t0, _), (t1, n) in zip(times[r], times[r][1:]):
            itl += [(t1 - t0) / n] * n
    first = min(times[r][0][0] for r in times)
    last = max(times[r][-1][0] for r in times)
    after_first = sum(len(tokens[r]) - 1 for r in tokens)
    delta = {k: stats[k] - before[k] for k in ("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens",
                                                "spec_draft_seconds", "spec_verify_seconds")}
    per_pos = [a - (before["spec_accepted_tokens_per_pos"][i] if i < len(before["spec_accepted_tokens_per_pos"]) else 0)
               for i, a in enumerate(stats["spec_accepted_tokens_per_pos"])]
    drafted_pos = [d - (before["spec_draft_tokens_per_pos"][i] if i < len(before["spec_draft_tokens_per_pos"]) else 0)
                   for i, d in enumerate(stats["spec_draft_tokens_per_pos"])]
    return {
        "speculative_config": spec, "streams": streams, "decode_tok_per_s": after_first / (last - first),
        "itl_p50_ms": 1000 * float(np.percentile(itl, 50)), "itl_p99_ms": 1000 * float(np.percentile(itl, 99)),
        "ttft_mean_ms": 1000 * float(np.mean(ttft)), **delta,
        "acceptance": delta["spec_accepted_tokens"] / delta["spec_draft_tokens"] if delta["spec_draft_tokens"] else None,
        "mean_accepted_length": 1 + delta["spec_accepted_tokens"] / delta["spec_num_drafts"] if delta["spec_num_drafts"] else None,
        "acceptance_per_position": [a / d if d else None for a, d in zip(per_pos, drafted_pos)],
        "tokens": [tokens[r] for r in sorted(tokens, key=lambda r: int(r.split("-")[1]))],
    }


def _line(label: str, plain: dict, fast: dict) -> str:
    acc = (f"acceptance {fast['acceptance']:.2f}, mean length {fast['mean_accepted_length']:.2f}, per position "
           f"{[round(a, 2) for a in fast['acceptance_per_position'] if a is not None]}"
           if fast["acceptance"] is not None else "no drafts")
    return (f"{label}, {plain['streams']:>2} stream(s): {plain['decode_tok_per_s']:.1f} -> {fast['decode_tok_per_s']:.1f} "
            f"tok/s ({fast['decode_tok_per_s'] / plain['decode_tok_per_s']:.2f}x); ITL p50 {plain['itl_p50_ms']:.1f} -> "
            f"{fast['itl_p50_ms']:.1f} ms, p99 {plain['itl_p99_ms']:.1f} -> {fast['itl_p99_ms']:.1f} ms; TTFT "
            f"{plain['ttft_mean_ms']:.0f} -> {fast['ttft_mean_ms']:.0f} ms; {acc}")


def _median_run(runs: list[dict]) -> dict:
    """The repetition with the median decode rate (its other figures with it)."""
    return sorted(runs, key=lambda r: r["decode_tok_per_s"])[len(runs) // 2]


def main() -> None:
    from pagoda.platform import cpu_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3, help="alternating plain / speculative runs per setting")
    parser.add_argument("--workloads", default="ngram,draft", help="ngram, draft or both")
    ns = parser.parse_args()
    results = []
    workloads = {"ngram": ("ngram on repetition", NGRAM, REPETITION), "draft": ("draft model on chat", DRAFT, CHAT)}
    for label, spec, prompts in (workloads[w] for w in ns.workloads.split(",")):
        plain_llm, spec_llm = engine(None), engine(spec)
        for streams in [int(s) for s in ns.streams.split(",")]:
            plains, fasts = [], []
            for _ in range(ns.repeats):  # alternating, so that the machine's drift hits both alike
                plains.append(run(plain_llm, None, prompts, streams))
                fasts.append(run(spec_llm, spec, prompts, streams))
                assert plains[-1]["tokens"] == fasts[-1]["tokens"], "speculation changed a greedy answer"
            plain, fast = _median_run(plains), _median_run(fasts)
            ratios = sorted(f["decode_tok_per_s"] / p["decode_tok_per_s"] for p, f in zip(plains, fasts))
            print(_line(label, plain, fast) + f"; ratios of the {ns.repeats} pairs {[round(r, 2) for r in ratios]}",
                  flush=True)
            for r in plains + fasts:
                r.pop("tokens")
            results.append({"workload": label, "streams": streams, "plain": plain, "speculative": fast,
                            "pair_ratios": ratios, "all_runs": plains + fasts})
        plain_llm.shutdown()
        spec_llm.shutdown()
    out = HERE / "results" / f"spec-decode-{date.today()}.json"
    out.write_text(json.dumps({"date": str(date.today()), "model": MODEL, "command": "python benchmarks/spec_decode.py",
                               "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))),
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
