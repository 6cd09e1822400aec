"""Baselines measured in the same harness: transformers `generate` and llama.cpp (llama-cpp-python).

Both are optional: a baseline whose package is missing raises `Unavailable`, which the benchmark
commands print and skip. transformers runs on exactly the weights pagoda loads (a GGUF is
dequantized the same way), in the dtype pagoda resolved; llama.cpp runs the GGUF itself, with its
own quantized kernels.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pagoda.loader.resolve import resolve_model


class Unavailable(RuntimeError):
    """An optional baseline that cannot run here (the message says why)."""


def gguf_file(model: str) -> Path | None:
    """The GGUF behind a `--model` name (a .gguf path, a directory holding one, a catalog name), else None."""
    return resolve_model(model).gguf_file


# -- transformers ---------------------------------------------------------------------------------

def load_transformers_model(model: str, dtype):
    """transformers' own model class on exactly the weights pagoda loads for `model`."""
    try:
        import torch  # optional: torch may be absent
        import transformers  # optional: transformers may be absent
    except ImportError as e:
        raise Unavailable(f"transformers is not installed ({e})") from None

    files = resolve_model(model)
    config = transformers.AutoConfig.from_pretrained(files.metadata_dir)
    if files.gguf_file is not None:
        from pagoda.loader.gguf_weights import iter_gguf_weights  # deferred: loads gguf, numpy, torch

        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        hf_model.load_state_dict(dict(iter_gguf_weights(files.gguf_file, files.hf_config())), strict=False)
        hf_model.tie_weights()
    else:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(files.metadata_dir, dtype=torch.float32)
    return hf_model.to(dtype).eval()


def hf_generate(model, prompts: list[list[int]], output_lens: list[int], batch_size: int, pad_id: int = 0) -> float:
    """Run `generate` over left-padded static batches (greedy, exactly the longest output length of
    each batch); returns the seconds taken. Shorter requests in a batch wait for its longest."""
    import torch  # torch loads on first use

    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch, outs = prompts[i:i + batch_size], output_lens[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(batch):  # left padding, as generate expects for decoder-only models
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            n = max(outs)
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=pad_id)
    return time.perf_counter() - start


# -- llama.cpp ------------------------------------------------------------------------------------

def _llama_cpp():
    try:
        import llama_cpp  # optional: llama_cpp may be absent
    except ImportError as e:
        raise Unavailable(
            f"llama-cpp-python is not installed ({e}); on a CPU like this one build it with "
            "CMAKE_ARGS='-DGGML_CPU_REPACK=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX512=OFF' "
            "pip install llama-cpp-python") from None
    return llama_cpp


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_llamacpp(gguf: Path, n_ctx: int, threads: int | None = None):
    llama_cpp = _llama_cpp()
    threads = threads or default_threads()
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads,
                           n_threads_batch=threads, verbose=False)


def llamacpp_generate(llm, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, list[int]]:
    """One request after another (llama-cpp-python's Python API runs one sequence), greedy, up to
    output_len tokens each (end-of-sequence is not a stop here); returns (seconds, tokens generated
    per request)."""
    start = time.perf_counter()
    produced = []
    for prompt, n in zip(prompts, output_lens):
        llm.reset()
        count = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if count >= n:
                break
        produced.append(count)
    return time.perf_counter() - start, produced


def llamacpp_server_command(gguf: Path, port: int, *, n_ctx: int, threads: int | None = None,
                            host: str = "127.0.0.1", model_alias: str | None = None) -> list[str]:
    """llama-cpp-python's OpenAI-compatible server on `gguf` (it serves one request at a time)."""
    _llama_cpp()
    threads = threads or default_threads()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", host, "--port", str(port),
           "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    if model_alias:
        cmd += ["--model_alias", model_alias]
    return cmd
