"""The naive transformers server, now `python -m pagoda.bench.hf_server` (kept for old commands).

    python benchmarks/hf_naive_server.py --model smollm2-135m-instruct --port 8001
"""

from pagoda.bench.hf_server import main

if __name__ == "__main__":
    main()
