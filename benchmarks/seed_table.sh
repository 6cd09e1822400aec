#!/usr/bin/env bash
# The seed-style table (benchmarks/README.md, "The seed's table"): every system on the same
# machine, back to back in one session. Run it on a quiet machine (nothing else on the cores).
#   bash benchmarks/seed_table.sh [path/to/llama-server]
set -euo pipefail
cd "$(dirname "$0")/.."
day=$(date +%F)
llama_server=${1:-}
systems=pagoda,pagoda-gguf
[ -n "$llama_server" ] && systems=$systems,llama-server
# Online: 1, 4, 16 and 64 concurrent streaming clients, 128 prompt / 128 output tokens.
python benchmarks/serve_bench.py --systems "$systems" ${llama_server:+--llama-server "$llama_server"} \
  --concurrency 1,4,16,64 --threads 2 --save "benchmarks/results/seed-serve-$day.json" \
  --plot-dir benchmarks/results/plots
# Offline: the same 64 requests; transformers at batch 1 (4 of them) and as one padded batch of 64.
python benchmarks/throughput.py --backend pagoda,hf --hf-batch-sizes 1,64 --threads 2 \
  --save-result "benchmarks/results/seed-offline-$day.json"
python benchmarks/throughput.py --backend pagoda,llamacpp --quantization gguf --threads 2 \
  --save-result "benchmarks/results/seed-offline-gguf-$day.json"
