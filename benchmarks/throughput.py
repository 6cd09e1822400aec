"""Offline throughput: pagoda vs transformers `generate` vs llama.cpp on the same model and prompts.

    python benchmarks/throughput.py                   # the run behind benchmarks/README.md
    python benchmarks/throughput.py --num-prompts 16  # any `pagoda bench throughput` option overrides

A shorthand for `pagoda bench throughput` with every backend: 64 requests of 128 prompt and 128
output tokens, transformers at batch 1 and as left-padded static batches of 16 and 64, llama.cpp one
request after another (the two one-at-a-time systems on 4 of the prompts: their tokens/s does not
depend on how many run in a row).
The result goes to benchmarks/results/throughput-<date>.json.
"""

import sys
from datetime import date
from pathlib import Path

from pagoda.cli import main

DEFAULTS = ["--backend", "pagoda,hf,llamacpp", "--num-prompts", "64", "--input-len", "128", "--output-len", "128",
            "--kv-cache-memory", "2", "--hf-batch-sizes", "1,16,64", "--serial-prompts", "4",
            "--save-result", str(Path(__file__).parent / "results" / f"throughput-{date.today().isoformat()}.json")]

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *DEFAULTS, *sys.argv[1:]]))
