"""The one place that asks which device this is and what it can do."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` says), for benchmark records."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


# The flags a benchmark record keeps beside its numbers: the vector and matrix extensions.
BENCHMARK_FLAG_PREFIXES = ("avx", "fma", "amx", "sse4", "f16c")


def benchmark_cpu_flags() -> list[str]:
    return sorted(f for f in cpu_flags() if f.startswith(BENCHMARK_FLAG_PREFIXES))


def default_device() -> torch.device:
    if torch.cuda.is_available() and os.environ.get("PAGODA_DEVICE", "") != "cpu":
        return torch.device("cuda")
    return torch.device("cpu")


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_SCALED_KV = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, quantization: str | None = None) -> torch.dtype:
    """``--kv-cache-dtype``: 'auto' keeps the model's dtype (exact), but for a GGUF's own quantized
    weights (``--quantization gguf``, already not exact) an fp32 model's cache is fp16, llama.cpp's
    default cache type: half the bytes a decode step's attention reads, twice the tokens in the
    same budget; bf16 / fp16 halve the cache of an fp32 model, its K/V rounded to nearest as they
    are written; int8 and fp8 (e4m3, the default fp8 as in vLLM, or e5m2) store codes per (token,
    head) with a float scale beside them."""
    from pagoda.engine_args import KV_CACHE_DTYPES

    key = str(name).lower()
    if key == "auto":
        return torch.float16 if quantization == "gguf" and model_dtype == torch.float32 else model_dtype
    if key in _SCALED_KV:
        return _SCALED_KV[key]
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return _DTYPES[key]


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a user dtype ('auto', 'float32', 'bfloat16', 'float16') to a torch dtype.

    'auto' picks bf16 on CUDA; on a CPU, bf16 only where it measured faster than fp32 at one row
    and at a batch (layers/dtype_choice.py), else fp32.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        from pagoda.layers.dtype_choice import auto_cpu_dtype

        return auto_cpu_dtype()
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    return _DTYPES[name]


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available system memory (CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def resident_memory_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
