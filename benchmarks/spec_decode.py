"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side in one run.

    python benchmarks/spec_decode.py        # writes results/spec-decode-<date>.json

SmolLM2-135M-Instruct fp32 (the catalog GGUF, dequantized), greedy, 128 new tokens, chat prompts
that ask for text the prompt already holds (repeat / lightly edit a paragraph, quote code): the
workload prompt lookup is for. 1, 4 and 16 streams through LLM.chat, with the default
`disable_by_batch_size` (4: no drafts above 4 running requests); decode tok/s = new tokens /
wall time after the prompt (a 1-token run is timed first and subtracted); acceptance from
engine stats.
"""

from __future__ import annotations

import json
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
PARAGRAPH = ("The paged KV cache stores keys and values in fixed-size blocks. A block table maps each "
             "sequence to its blocks, so memory is allocated on demand and shared between requests "
             "that start with the same prompt.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
TASKS = [f"Repeat this text exactly:\n\n{PARAGRAPH}", f"Copy this code and add a docstring to each function:\n\n{CODE}",
         f"Rewrite this text, replacing 'blocks' with 'pages':\n\n{PARAGRAPH}", f"Quote this code back:\n\n{CODE}"]


def run(spec: dict | None, streams: int) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory=0.5, speculative_config=spec)
    conversations = [[{"role": "user", "content": TASKS[i % len(TASKS)]}] for i in range(streams)]
    llm.chat(conversations, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # warm the prefix cache
    start = time.perf_counter()
    llm.chat(conversations, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    prefill = time.perf_counter() - start
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = llm.chat(conversations, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start - prefill
    stats = llm.engine.stats()
    drafts = stats["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"speculative_config": spec, "streams": streams, "decode_tok_per_s": tokens / seconds,
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance": accepted / drafts if drafts else None, "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    from pagoda.platform import cpu_flags

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    runs = []
    for streams in (1, 4, 16):
        plain, fast = run(None, streams), run(spec, streams)
        assert plain["tokens"] == fast["tokens"], "speculation changed a greedy answer"
        runs += [plain, fast]
        print(f"{streams} stream(s): {plain['decode_tok_per_s']:.1f} -> {fast['decode_tok_per_s']:.1f} tok/s "
              f"({fast['decode_tok_per_s'] / plain['decode_tok_per_s']:.2f}x), acceptance "
              f"{fast['accepted_tokens']}/{fast['draft_tokens']}")
    for r in runs:
        del r["tokens"]
    out = HERE / "results" / f"spec-decode-{date.today()}.json"
    out.write_text(json.dumps({"date": str(date.today()), "cpu_flags": sorted(
        f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))), "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
