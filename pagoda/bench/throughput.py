"""`pagoda bench throughput`: offline throughput through `pagoda.LLM`, and baselines in the same run.

Every system gets the same prompts (token ids) and generates exactly each request's output length
(greedy, end-of-sequence ignored), so all do the same work. Backends (``--backend``, comma-separated):

- ``pagoda``: `LLM.generate` over all requests at once (continuous batching).
- ``hf``: transformers `generate` on the same weights and dtype, as left-padded static batches of
  each size in ``--hf-batch-sizes`` (``1`` runs one request after another).
- ``llamacpp``: llama-cpp-python on the model's GGUF, one request after another.

The systems that run one request after another (hf at batch 1, llamacpp) can run only the first
``--serial-prompts`` requests: their tokens/s does not depend on how many run in a row.

A baseline that is not installed is skipped with a message.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import sys
import time

from pagoda import SamplingParams
from pagoda.bench import baselines, datasets
from pagoda.bench.latency_stats import format_spec, spec_from_stats, spec_summary
from pagoda.bench.serve import environment, loadavg, save_json
from pagoda.tokenizer import Tokenizer

BACKENDS = ("pagoda", "hf", "llamacpp")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """Options after the engine's (which bring --model, --dtype and --seed)."""
    datasets.add_cli_args(p, num_prompts_help="requests (default: 64)", seed=False)
    g = p.add_argument_group("backends")
    g.add_argument("--backend", default="pagoda", help=f"comma-separated, of {', '.join(BACKENDS)} (default: pagoda)")
    g.add_argument("--hf-batch-sizes", default="1", help="static batch sizes for the hf backend (default: 1)")
    g.add_argument("--serial-prompts", type=int, default=None,
                   help="run only this many prompts on hf at batch size 1 and on llamacpp (default: all)")
    g.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    g.add_argument("--save-result", default=None, metavar="FILE.json")


def _parse_backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"--backend takes {', '.join(BACKENDS)} (comma-separated), got {text!r}")
    return names


def _result(label: str, prompts: list[list[int]], output_lens: list[int], seconds: float, **extra) -> dict:
    inp, out = sum(len(p) for p in prompts), sum(output_lens)
    return {"label": label, "requests": len(prompts), "input_tokens": inp, "output_tokens": out, "elapsed_s": seconds,
            "requests_per_s": len(prompts) / seconds, "input_tokens_per_s": inp / seconds,
            "output_tokens_per_s": out / seconds, "total_tokens_per_s": (inp + out) / seconds, "loadavg_1m": loadavg(),
            **extra}


def run_pagoda(engine_args, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from pagoda import LLM  # deferred: loads torch (`pagoda bench serve` imports this module for its options)

    llm = LLM(**dataclasses.asdict(engine_args))
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    spec_before = spec_from_stats(llm.engine.stats())
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = [len(o.outputs[0].token_ids) for o in outs]
    return _result("pagoda", prompts, generated, seconds, backend="pagoda", steps=llm.engine.core.num_steps,
                   dtype=str(llm.engine.config.model.dtype).removeprefix("torch."),
                   spec_decode=spec_summary(spec_before, spec_from_stats(llm.engine.stats())))


def run_hf(model: str, dtype, prompts, output_lens, batch_sizes: list[int], serial_prompts: int | None) -> list[dict]:
    hf_model = baselines.load_transformers_model(model, dtype)
    baselines.hf_generate(hf_model, [prompts[0][:8]], [2], 1)  # warm-up
    results = []
    for bs in batch_sizes:
        n = len(prompts) if bs > 1 else _serial(len(prompts), serial_prompts)
        seconds = baselines.hf_generate(hf_model, prompts[:n], output_lens[:n], bs)
        results.append(_result(f"transformers batch {bs}", prompts[:n], output_lens[:n], seconds, backend="hf",
                               batch_size=bs, dtype=str(dtype).removeprefix("torch.")))
        _print_line(results[-1])
    return results


def _serial(n: int, serial_prompts: int | None) -> int:
    return n if serial_prompts is None else max(1, min(serial_prompts, n))


def run_llamacpp(model: str, prompts, output_lens, threads: int | None, serial_prompts: int | None) -> dict:
    gguf = baselines.gguf_file(model)
    if gguf is None:
        raise baselines.Unavailable(f"llama.cpp needs a GGUF model; {model!r} is not one")
    n_ctx = max(len(p) + n for p, n in zip(prompts, output_lens)) + 16
    llm = baselines.load_llamacpp(gguf, n_ctx, threads)
    baselines.llamacpp_generate(llm, [prompts[0][:8]], [2])  # warm-up
    n = _serial(len(prompts), serial_prompts)
    seconds, generated = baselines.llamacpp_generate(llm, prompts[:n], output_lens[:n])
    return _result("llama.cpp (one request at a time)", prompts[:n], generated, seconds, backend="llamacpp",
                   threads=threads or baselines.default_threads(), gguf=gguf.name)


def _print_line(r: dict) -> None:
    print(f"{r['label']}: {r['requests_per_s']:.2f} requests/s, {r['input_tokens_per_s']:.1f} input tokens/s, "
          f"{r['output_tokens_per_s']:.1f} output tokens/s ({r['requests']} requests, {r['input_tokens']} + "
          f"{r['output_tokens']} tokens in {r['elapsed_s']:.1f} s)", flush=True)
    if r.get("spec_decode"):
        print("\n".join(format_spec(r["spec_decode"])), flush=True)


def format_table(results: list[dict]) -> str:
    base = results[0]["output_tokens_per_s"]
    lines = [f"{'system':<36} {'requests':>8} {'out tokens':>10} {'seconds':>8} {'req/s':>7} {'in tok/s':>9} "
             f"{'out tok/s':>9} {'vs ' + results[0]['label']:>12}"]
    for r in results:
        lines.append(f"{r['label']:<36} {r['requests']:>8} {r['output_tokens']:>10} {r['elapsed_s']:>8.1f} "
                     f"{r['requests_per_s']:>7.2f} {r['input_tokens_per_s']:>9.1f} {r['output_tokens_per_s']:>9.1f} "
                     f"{r['output_tokens_per_s'] / base:>11.2f}x")
    return "\n".join(lines)


def main(ns: argparse.Namespace, engine_args) -> int:
    from pagoda.config import create_engine_config  # deferred: loads torch

    backends = _parse_backends(ns.backend)
    batch_sizes = [int(x) for x in ns.hf_batch_sizes.split(",") if x.strip()]
    config = create_engine_config(engine_args)
    tokenizer = Tokenizer(config.model.files.metadata_dir, config.model.chat_template)
    requests = datasets.build_requests(ns, tokenizer, ns.num_prompts or 64, as_text=False)
    prompts = [r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt) for r in requests]
    output_lens = [r.output_len for r in requests]

    results, skipped = [], {}
    for backend in backends:
        try:
            if backend == "pagoda":
                results.append(run_pagoda(engine_args, prompts, output_lens))
                _print_line(results[-1])
            elif backend == "hf":
                results += run_hf(ns.model, config.model.dtype, prompts, output_lens, batch_sizes, ns.serial_prompts)
            else:
                results.append(run_llamacpp(ns.model, prompts, output_lens, ns.threads, ns.serial_prompts))
                _print_line(results[-1])
        except baselines.Unavailable as e:
            skipped[backend] = str(e)
            print(f"skipping {backend}: {e}", file=sys.stderr)
        gc.collect()
    if len(results) > 1:
        print(format_table(results))
    if ns.save_result:
        import torch  # torch loads on first use

        save_json(ns.save_result, {**environment(ns), "machine": {"cpu": platform.processor() or platform.machine(),
                                                                  "torch_threads": torch.get_num_threads(),
                                                                  "torch": torch.__version__},
                                   "results": results, "skipped": skipped})
    return 0 if results else 1
