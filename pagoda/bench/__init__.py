"""Benchmark tools, part of the product like `vllm bench`.

- ``pagoda bench throughput``: offline, through ``pagoda.LLM`` (or a baseline: transformers
  ``generate``, llama.cpp through llama-cpp-python), N prompts of given or sampled lengths or a
  JSONL file; requests/s, input and output tokens/s.
- ``pagoda bench serve``: a load generator for any OpenAI-compatible server; fixed concurrency or
  Poisson arrivals, streaming; TTFT, TPOT, ITL and end-to-end latency percentiles, goodput under
  SLOs, and a concurrency sweep that finds the largest concurrency meeting the SLOs and plots it.

Modules: ``datasets`` (what to send), ``latency_stats`` (percentiles, goodput), ``throughput``,
``serve``, ``sweep``, ``plots`` (matplotlib, the ``bench`` extra), ``baselines`` (transformers,
llama.cpp).
"""
